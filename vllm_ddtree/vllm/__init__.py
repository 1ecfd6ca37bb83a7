"""vLLM integration of DDTree: the only package of vllm_ddtree that imports vLLM.

plugin (entry point) -> patches (declared via patching) -> config (method 'ddtree' contract) ->
worker -> runner (verify, walk, KV compaction) + proposer (DFlash top-k -> trees) + attention
(tree-masked CPU attention over paged_kv).
"""

"""Command-line tools for the engineers of vllm_ddtree (not used at run time)."""

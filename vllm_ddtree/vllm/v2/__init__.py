"""Method 'ddtree' on vLLM's V2 model runner (runner path "v2", `V2_RUNNER_RELEASES`): hooks and
readers only; the step's logic is shared with the V1 layer (docs/v2_runner.md, section 2)."""

"""The V1 model runner layer: hooks and readers of vLLM's V1 runner state (vLLM 0.32 and 0.33; 0.34 has no V1)."""

"""vllm_ddtree: DDTree speculative decoding (DFlash block drafts verified as a tree) for vLLM."""

SUPPORTED_VLLM = "0.32.0"
"""The only vLLM version this package runs against; the plugin refuses any other at start-up."""

__all__ = ["SUPPORTED_VLLM"]

"""Test pairs: the synthetic pairs live in the package (the demo uses them until a trained pair ships)."""

from vllm_ddtree.demo.synthetic_pair import BLOCK_SIZE, EOS_TOKEN_ID, FOCUS, MASK_TOKEN_ID, VOCAB, build_pair

__all__ = ["BLOCK_SIZE", "EOS_TOKEN_ID", "FOCUS", "MASK_TOKEN_ID", "VOCAB", "build_pair"]

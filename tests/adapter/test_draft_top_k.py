"""The draft's top-K at a fixed width (what the V2 speculator's `sample_draft` writes into its persistent
buffers, graph-safe) narrowed to a step's candidates (`drafting.narrow_top_k`) equals the top-K taken at
that width directly (`drafting.draft_top_k`), the chain's K = 1 form included, for rows with -inf logits
(a cut chain) too."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.vllm.drafting import draft_top_k, narrow_top_k


@pytest.mark.parametrize("candidates", [1, 2, 5, 8])
def test_narrowed_fixed_width_top_k_equals_the_top_k_of_the_candidates(candidates: int):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 64, generator=generator) * 3  # continuous values: no ties between ranks
    logits[3] = float("-inf")  # no finite maximum: the chain is cut there
    logits[5, :60] = float("-inf")  # four finite tokens only
    wide = draft_top_k(logits, 8)
    logprobs, token_ids = narrow_top_k(*wide, candidates)
    expected_logprobs, expected_ids = draft_top_k(logits, candidates)
    finite = expected_logprobs.isfinite()  # -inf ranks may hold any of the tied tokens
    assert torch.equal(logprobs.isfinite(), finite)
    assert torch.equal(token_ids[finite], expected_ids[finite])
    torch.testing.assert_close(logprobs[logprobs.isfinite()], expected_logprobs[expected_logprobs.isfinite()])

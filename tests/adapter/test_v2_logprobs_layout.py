"""The V2 layer's logprobs layout without an engine (`v2/logprobs.py`, D13): the emitted tokens' rows
moved to the first rows of each request's block of logits rows come back out of vLLM's own slicing
(`LogprobsTensors.tolists`, `LogprobsLists.slice_request`, what V2's `AsyncOutput` and the scheduler do
with a speculative step's logprobs) as each request's tokens in order, and nothing else."""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors

from vllm_ddtree.vllm.logprobs import EmittedTokens
from vllm_ddtree.vllm.v2.logprobs import block_rows, in_logits_layout

# a request with 6 drafts accepting 2 (+ bonus), one without drafts (a prefill's last chunk), one with 4
# drafts accepting all (+ bonus: its whole block)
OUTPUT = torch.tensor([
    [11, 12, 13, -1, -1],
    [21, -1, -1, -1, -1],
    [31, 32, 33, 34, 35],
])
CU_NUM_LOGITS = np.array([0, 7, 8, 13], dtype=np.int32)


def _emitted(output: torch.Tensor) -> EmittedTokens:
    requests, columns = (output >= 0).nonzero(as_tuple=True)
    return EmittedTokens(requests, columns, output[requests, columns].long(), source=torch.empty(0, 1), rows=torch.empty(0, dtype=torch.int64))


def test_emitted_rows_are_the_first_rows_of_each_block():
    rows = block_rows(CU_NUM_LOGITS, _emitted(OUTPUT))
    assert rows.tolist() == [0, 1, 2, 7, 8, 9, 10, 11, 12]


def test_vllms_slicing_gives_each_request_its_emitted_tokens_rows_in_order():
    emitted = _emitted(OUTPUT)
    num_emitted = len(emitted.token_ids)
    top = torch.arange(num_emitted * 2).view(num_emitted, 2) + 100  # two top-n ids per token
    scores = LogprobsTensors(
        torch.cat([emitted.token_ids.unsqueeze(1), top], dim=1),
        -torch.arange(num_emitted * 3, dtype=torch.float32).view(num_emitted, 3) / 7,
        torch.arange(num_emitted) + 1,
    )
    laid = in_logits_layout(scores, block_rows(CU_NUM_LOGITS, emitted), CU_NUM_LOGITS)
    assert laid.logprobs.shape == (int(CU_NUM_LOGITS[-1]), 3)
    lists = laid.tolists()
    first = 0
    for request, num_sampled in enumerate((OUTPUT >= 0).sum(dim=1).tolist()):
        sliced = lists.slice_request(request, num_sampled)
        mine = slice(first, first + num_sampled)
        assert np.array_equal(sliced.logprob_token_ids[:, 0], OUTPUT[request, :num_sampled].numpy())
        assert np.array_equal(sliced.logprob_token_ids, scores.logprob_token_ids[mine].numpy())
        assert np.array_equal(sliced.logprobs, scores.logprobs[mine].numpy())
        assert np.array_equal(sliced.sampled_token_ranks, scores.selected_token_ranks[mine].numpy())
        first += num_sampled
    assert first == num_emitted

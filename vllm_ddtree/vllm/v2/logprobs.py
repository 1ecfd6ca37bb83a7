"""The V2 layer's logprobs of a step the core rule drew (D13): each emitted token's from the row of the
tree node it was drawn at (the shared row choice, `vllm/logprobs.py`), scored by V2's own
`compute_topk_scores` and laid out as V2's `AsyncOutput` reads a speculative step's logprobs.

V2's layout (its rejection sampler's for a chain): one logprobs row per logits row of the step, request
r's block the rows cu_num_logits[r] .. cu_num_logits[r + 1] (1 + its drafts), its k-th emitted token at
row cu_num_logits[r] + k, and `cu_num_generated_tokens` = cu_num_logits; `AsyncOutput` (via the
scheduler's `slice_request`) keeps the first num_sampled rows of each block. A request emits at most
1 + its drafts tokens (its accepted path and the bonus token), so its rows fit its block; the rows after
them are zero (never read).

What each request gets is V2's rule for plain decoding: the token, then its `logprob_token_ids` if it
set them, else the batch's top n (-inf padded); values log-softmaxed in the *_logprobs modes. The rows
scored are the shared rule's (`emitted_logit_values`), so the processed modes report what V1's layer
reports (greedy requests: their raw rows).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

from vllm_ddtree.vllm.logprobs import EmittedTokens, emitted_logit_values, emitted_tokens
from vllm_ddtree.vllm.options import RequestOptions
from vllm_ddtree.vllm.tree_step import TreeStep


def v2_emitted_logprobs(
    sampler: Any,
    input_batch: Any,
    dims: tuple[int, int] | None,
    options: RequestOptions,
    logits: torch.Tensor,
    processed: torch.Tensor | None,
    step: TreeStep,
    output: torch.Tensor,
) -> LogprobsTensors | None:
    """Logprobs of every emitted token of `step` in V2's layout (module docstring), None when dims is None
    (no request of the batch asked for logprobs). sampler: V2's `Sampler` (its logprobs mode and
    `logprob_token_ids` state); dims: its `get_logprobs_dims` of the batch, (top n, the most
    `logprob_token_ids` a request set); options: the batch's; logits [num_logits, V]: the step's logits
    rows; processed, output: as `emitted_tokens`. Computed on the logits' device."""
    if dims is None:
        return None
    num_logprobs, max_token_ids = dims
    mode = sampler.logprobs_mode
    device = logits.device
    emitted = emitted_tokens(logits, processed, step, output, mode)
    requests = emitted.requests.to(device)
    params = options.sampling_params(top_k_one_is_greedy=False)
    values = emitted_logit_values(emitted.source, emitted.rows.to(device), requests, params, mode)
    scores = compute_topk_scores(
        values,
        num_logprobs,
        emitted.token_ids.to(device),
        logprob_token_ids_state=sampler.logprob_token_ids_state,
        expanded_idx_mapping=input_batch.idx_mapping[requests],  # each token's request-state slot
        max_per_req_token_ids=max_token_ids,
        logits_mode=mode.endswith("logits"),
    )
    cu_num_logits = input_batch.cu_num_logits_np
    return in_logits_layout(scores, block_rows(cu_num_logits, emitted), cu_num_logits)


def block_rows(cu_num_logits: np.ndarray, emitted: EmittedTokens) -> torch.Tensor:
    """[M] int64 (host): each emitted token's row in V2's layout, cu_num_logits[request] + column.
    cu_num_logits [R + 1]: the running sum of each request's logits rows."""
    return torch.from_numpy(cu_num_logits.astype(np.int64))[emitted.requests] + emitted.columns


def in_logits_layout(scores: LogprobsTensors, rows: torch.Tensor, cu_num_logits: np.ndarray) -> LogprobsTensors:
    """`scores` (one row per emitted token) moved to `rows` [M] (host) of cu_num_logits[-1] rows, the
    others zero, with the block boundaries V2's output slices by."""
    num_rows, width = int(cu_num_logits[-1]), scores.logprob_token_ids.shape[1]
    device = scores.logprobs.device
    token_ids = scores.logprob_token_ids.new_zeros(num_rows, width)
    logprobs = scores.logprobs.new_zeros(num_rows, width)
    ranks = scores.selected_token_ranks.new_zeros(num_rows)
    rows = rows.to(device)
    token_ids[rows], logprobs[rows], ranks[rows] = scores.logprob_token_ids, scores.logprobs, scores.selected_token_ranks
    return LogprobsTensors(token_ids, logprobs, ranks, cu_num_generated_tokens=cu_num_logits.tolist())

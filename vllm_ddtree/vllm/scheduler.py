"""vLLM's scheduler for method 'ddtree' engines on CPU, without placeholder drafts.

vLLM 0.32's scheduler pads a request that joins a decoding batch with one token to compute (a one-token
prompt, a prompt the prefix cache holds but for its last token, a resumed request) to 1 +
num_speculative_tokens rows of placeholder drafts, so that the step's batch stays uniform for full CUDA
graphs ("pad new decode requests to uniform spec decoding size"); when the token budget has no room for
the padded rows, it leaves the request waiting rather than schedule it unpadded. The CPU runs no graphs:
the padding is only target-forward rows verified as a chain and rejected (33 with the default cap of 32,
where the request needed one), and a step's delay. vLLM pads only while it has no per-batch-size table of
speculative tokens (`dynamic_sd_lookup`, dynamic speculative decoding); a table giving every batch size
the configured num_speculative_tokens schedules exactly the drafts no table does (the table's one other
use), and so turns the padding alone off.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler


class UnpaddedScheduler(Scheduler):
    """vLLM's `Scheduler`; a request with one token to compute is scheduled as that one token."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.num_spec_tokens > 0 and self.dynamic_sd_lookup is None:
            # indexed by the step's number of requests, as vLLM's own table (index 0 unused)
            self.dynamic_sd_lookup = [self.num_spec_tokens] * (self.scheduler_config.max_num_seqs + 1)

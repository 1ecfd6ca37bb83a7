"""Whether a batch's departures are refilled: the evidence behind the tail discount (`AdaptiveBudget._rates`).

Under speculation a batch's requests progress unevenly. A batch that drains (one `LLM.generate` call
that fits the engine) ends with a tail of steps that run its slowest few requests, a cost no step's
rate shows. A batch whose departures are refilled has no such tail while its load lasts: a server's
clients send their next request as an answer arrives, and the scheduler admits a waiting request in the
step after one finishes.

Rules:
- A departure is refilled when an arrival follows it within REFILL_WITHIN_STEPS engine steps while the
  batch still runs. Departures that empty the batch are never refilled: the next arrivals start a new
  batch (a new `generate` call after the last one drained), and their first steps are not a refill.
- `share` is the decayed share of recent departures that were refilled: 0 before any evidence, so a
  batch is taken to drain until its departures show otherwise.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

REFILL_WITHIN_STEPS = 8
"""Engine steps after a departure within which an arrival refills it: a client's next request reaches
the engine a few steps after its answer left (the answer's detokenization, the network, the server's
queue), a waiting request the very next step."""

DECAY = 0.9
"""Weight kept per departure by `share`: a memory of about ten departures, so a server's load that
ends (its last requests drain) brings the discount back within a few departures."""


@dataclass
class Refills:
    """The refilled share of a batch's recent departures (the module's rules), counting engine steps by
    `tick`. One per engine: the regimes' policies share it (`SamplingRegimes`)."""

    share: float = 0.0
    steps: int = 0
    _open: deque[int] = field(default_factory=deque)
    """The step of each departure not yet refilled, oldest first."""

    def tick(self) -> None:
        """An engine step ran."""
        self.steps += 1

    def departed(self, count: int, remaining: int) -> None:
        """`count` requests left the batch, leaving `remaining` in it."""
        self._expire()
        if remaining == 0:
            for _ in range(len(self._open) + count):
                self._record(0.0)
            self._open.clear()
            return
        self._open.extend([self.steps] * count)

    def arrived(self, count: int) -> None:
        """`count` requests joined the batch: each refills the oldest open departure."""
        self._expire()
        for _ in range(min(count, len(self._open))):
            self._open.popleft()
            self._record(1.0)

    def refilled_share(self) -> float:
        """`share`, departures left open longer than REFILL_WITHIN_STEPS counted as not refilled."""
        self._expire()
        return self.share

    def _expire(self) -> None:
        while self._open and self.steps - self._open[0] > REFILL_WITHIN_STEPS:
            self._open.popleft()
            self._record(0.0)

    def _record(self, refilled: float) -> None:
        self.share = DECAY * self.share + (1 - DECAY) * refilled

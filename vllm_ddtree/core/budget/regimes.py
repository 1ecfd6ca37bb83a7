"""Greedy and sampled batches keep apart policies.

Rule: acceptance depends on the sampling as much as on the text (greedy trees accept several tokens per
step where sampling accepts about one), and a policy holding off measures no speculative shape's
tokens. Pooled over regimes, a server that turns from sampled requests back to greedy ones would hold
off on the sampled text's estimates until re-probes found the trees again. Apart, each regime resumes
with its own held shape and estimates when the traffic turns, its steps' timings re-measuring the
machine's speed (`AdaptiveBudget._time`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_ddtree.core.budget.policy import AdaptiveBudget
from vllm_ddtree.core.budget.shapes import TreeShape


@dataclass
class SamplingRegimes:
    """One `AdaptiveBudget` over `shapes` for greedy batches (every request at T = 0) and one for batches
    that sample (any request at T > 0), each made on first use. The runner names the regime of each
    step's batch (`use`) before the step chooses the next step's shape; the choice and the step's own
    observation (reported when the next step starts, before its `use`) go to that regime's policy."""

    shapes: list[TreeShape]
    policies: dict[bool, AdaptiveBudget] = field(default_factory=dict)
    greedy: bool = True
    startup_costs: dict[tuple[int, TreeShape], float] = field(default_factory=dict)
    """Costs timed when the engine starts, seconds[(num_requests, shape)], every regime's policy starts
    from (`AdaptiveBudget.seed_costs`): step costs follow the batch, not the sampling."""

    def seed_costs(self, seconds: dict[tuple[int, TreeShape], float]) -> None:
        """Start every regime's policy, made or to be made, from these start-up costs."""
        self.startup_costs = dict(seconds)
        for policy in self.policies.values():
            policy.seed_costs(self.startup_costs)

    def use(self, greedy: bool) -> None:
        """This step's batch is greedy (every request at T = 0), or samples."""
        self.greedy = greedy

    @property
    def policy(self) -> AdaptiveBudget:
        """The policy of the regime in use."""
        policy = self.policies.get(self.greedy)
        if policy is None:
            policy = self.policies[self.greedy] = AdaptiveBudget(self.shapes)
            policy.seed_costs(self.startup_costs)
        return policy

    def choose(self, num_requests: int, context_tokens: float = 0.0) -> TreeShape:
        return self.policy.choose(num_requests, context_tokens)

    def observe(
        self, num_requests: int, used: TreeShape, seconds: float | None, tokens: dict[TreeShape, float], context_tokens: float = 0.0
    ) -> None:
        self.policy.observe(num_requests, used, seconds, tokens, context_tokens)

    def requests_arrived(self, num_requests: int) -> None:
        """Told to every regime's policy: the new request's regime is not known yet, and new text is new
        to either."""
        for policy in self.policies.values():
            policy.requests_arrived(num_requests)

"""A budget policy whose choices a test scripts: the shapes of successive steps, cycled."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_ddtree.core import TreeShape


@dataclass
class ScriptedBudget:
    """Step i runs `script[i % len(script)]`, whatever the batch; observations are recorded only.
    `shapes` are the candidates the runner reads accepted tokens of (`accepted_by_shape`)."""

    shapes: list[TreeShape]
    script: list[TreeShape]
    chosen: list[TreeShape] = field(default_factory=list)
    observed: int = 0

    def choose(self, num_requests: int, context_tokens: float = 0.0) -> TreeShape:
        shape = self.script[len(self.chosen) % len(self.script)]
        self.chosen.append(shape)
        return shape

    def observe(self, num_requests: int, used: TreeShape, seconds: float | None, tokens: dict[TreeShape, float], context_tokens: float = 0.0) -> None:
        self.observed += 1

    def requests_arrived(self, num_requests: int) -> None:
        pass

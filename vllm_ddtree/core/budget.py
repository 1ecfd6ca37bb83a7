"""Adaptive tree budget: each step, how many nodes of its best-first tree every request verifies.

Rule. A node v is accepted with probability about c * p(v), where p(v) = exp(score(v)) is the draft's
probability of v's whole path and c a calibration learned online (accepted tokens / predicted tokens).
A step that verifies M tree nodes over R requests commits R + c * sum(p) tokens in expectation and
costs about a(R) + w * M seconds, with a and w fitted online to measured step times. We verify the M
nodes of highest p across the whole batch (each request's tree cut to a prefix of its best-first
order, so still prefix-closed) with M maximising expected tokens per second. M = 0 is a plain decoding
step (the draft still runs, which keeps its context current); M small gives chains; M large, big trees.
The budget configured is the cap: trees are built at that size and only cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_ddtree.core.tree import DraftTree


def path_probabilities(tree: DraftTree, top_logprobs: torch.Tensor) -> torch.Tensor:
    """[R, N] float64: draft probability of each node's path from the root (root 1.0, padding 0.0).

    top_logprobs [R, L, K] is what the tree was built from; node i's own log-prob is
    top_logprobs[r, depths[i] - 1, ranks[i]]."""
    depth_index = (tree.depths - 1).clamp(min=0)
    own = top_logprobs.to(torch.float64).gather(2, tree.ranks.unsqueeze(1).expand(-1, top_logprobs.shape[1], -1))
    own = own.gather(1, depth_index.unsqueeze(1)).squeeze(1)
    own = torch.where(tree.valid & (tree.depths > 0), own, 0.0)
    total = own.clone()
    ancestor = tree.parents
    for _ in range(tree.max_depth):
        has = ancestor >= 0
        total += torch.where(has, own.gather(1, ancestor.clamp(min=0)), 0.0)
        ancestor = torch.where(has, tree.parents.gather(1, ancestor.clamp(min=0)), -1)
    return torch.where(tree.valid, total.exp(), 0.0)


def best_node_order(probabilities: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(request index, probability) of every non-root valid node, most probable first.

    Within a request, probabilities never increase along index order (best-first trees), and ties keep
    index order (stable sort), so any prefix of the result takes a prefix of each request's tree."""
    values = probabilities[:, 1:]
    requests = torch.arange(values.shape[0]).unsqueeze(1).expand_as(values)
    keep = values > 0
    values, requests = values[keep], requests[keep]
    order = torch.sort(values, descending=True, stable=True).indices
    return requests[order], values[order]


def best_node_count(
    node_probabilities: torch.Tensor, num_requests: int, calibration: float, base_seconds: float, node_seconds: float
) -> int:
    """M in 0..len(node_probabilities) maximising (R + c * sum of the first M) / (base + node_seconds * M);
    the smallest such M on ties. node_probabilities are sorted descending."""
    expected = num_requests + calibration * torch.cat([torch.zeros(1, dtype=torch.float64), node_probabilities.cumsum(0)])
    cost = base_seconds + node_seconds * torch.arange(expected.shape[0], dtype=torch.float64)
    return int(torch.argmax(expected / cost.clamp(min=1e-9)))


def node_counts(requests: torch.Tensor, num_requests: int, count: int) -> torch.Tensor:
    """[R] nodes each request verifies when the first `count` of `best_node_order` are taken."""
    return torch.bincount(requests[:count], minlength=num_requests)


@dataclass
class StepCostModel:
    """Step seconds ~ a0 + a1 * requests + w * extra_rows, fitted by exponentially weighted least
    squares (forgetting `decay` per step, a small ridge keeps it solvable before the data varies).
    extra_rows = scheduled tokens beyond one per request (tree nodes, prefill chunks)."""

    decay: float = 0.98
    ridge: float = 1e-6
    _xx: torch.Tensor = field(default_factory=lambda: torch.zeros(3, 3, dtype=torch.float64))
    _xy: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))
    observations: int = 0

    def observe(self, requests: int, extra_rows: int, seconds: float) -> None:
        x = torch.tensor([1.0, requests, extra_rows], dtype=torch.float64)
        self._xx.mul_(self.decay).add_(torch.outer(x, x))
        self._xy.mul_(self.decay).add_(x * seconds)
        self.observations += 1

    def coefficients(self) -> tuple[float, float, float]:
        """(a0, a1, w), each clamped at >= 0."""
        scale = self._xx.diagonal().clamp(min=1.0)
        solved = torch.linalg.solve(self._xx + self.ridge * torch.diag(scale), self._xy)
        a0, a1, w = solved.clamp(min=0.0).tolist()
        return a0, a1, w


@dataclass
class AcceptanceCalibration:
    """c = accepted draft tokens / predicted (sum of verified nodes' path probabilities), decayed."""

    decay: float = 0.95
    accepted: float = 1.0
    predicted: float = 1.0

    def observe(self, predicted: float, accepted: float) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.predicted = self.decay * self.predicted + predicted

    @property
    def factor(self) -> float:
        return min(2.0, max(0.05, self.accepted / max(self.predicted, 1e-9)))


@dataclass
class AdaptiveBudget:
    """Chooses each step's node counts (see the module rule) from the trees and the online models.

    The first `warmup_steps` choices cycle through fixed fractions of the available nodes, and later a
    fraction `explore` of the steps takes a random count (seeded): the cost fit needs steps of
    different sizes."""

    warmup_steps: int = 10
    explore: float = 0.05
    seed: int = 0
    cost: StepCostModel = field(default_factory=StepCostModel)
    calibration: AcceptanceCalibration = field(default_factory=AcceptanceCalibration)
    _steps: int = 0
    _rng: torch.Generator | None = None

    WARMUP_FRACTIONS = (1.0, 0.0, 0.5, 0.25, 0.75)

    def choose(self, probabilities: torch.Tensor) -> torch.Tensor:
        """[R] node counts (root excluded) for trees with these path probabilities [R, N]."""
        if self._rng is None:
            self._rng = torch.Generator().manual_seed(self.seed)
        num_requests = probabilities.shape[0]
        requests, values = best_node_order(probabilities)
        available = values.shape[0]
        step = self._steps
        self._steps += 1
        if step < self.warmup_steps:
            count = round(self.WARMUP_FRACTIONS[step % len(self.WARMUP_FRACTIONS)] * available)
        elif float(torch.rand(1, generator=self._rng)) < self.explore:
            count = int(torch.randint(0, available + 1, (1,), generator=self._rng))
        else:
            a0, a1, w = self.cost.coefficients()
            count = best_node_count(values, num_requests, self.calibration.factor, a0 + a1 * num_requests, w)
        return node_counts(requests, num_requests, count)

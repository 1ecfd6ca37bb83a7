"""`function_timers` counts every call of the targets an engine has, once each, and skips the rest."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_ddtree.demo import function_timers


class _Runner:
    def step(self, n: int) -> int:
        return self.inner(n) + 1

    def inner(self, n: int) -> int:
        return 2 * n


def test_installs_each_target_once_counts_calls_and_skips_missing_owners():
    worker = SimpleNamespace(model_runner=_Runner())
    targets = ["runner.step", "runner.inner", "drafter.propose", "runner.missing"]
    assert function_timers.install(worker, targets) == ["runner.step", "runner.inner"]
    assert function_timers.install(worker, targets) == []  # already timed: not wrapped twice
    before = function_timers.read(worker)
    assert [worker.model_runner.step(n) for n in range(3)] == [1, 3, 5]
    after = function_timers.read(worker)
    for name in ("runner.step", "runner.inner"):
        seconds, calls = after[name]
        assert calls - before.get(name, (0.0, 0))[1] == 3 and seconds >= before.get(name, (0.0, 0))[0]
    assert "drafter.propose" not in after

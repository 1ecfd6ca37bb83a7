"""The demo's closing paragraph and headline are computed from the run's summaries (no engine)."""

from __future__ import annotations

from vllm_ddtree.demo.__main__ import Scenario, ScenarioResult, headline, stage_paragraph
from vllm_ddtree.demo.engines import Work
from vllm_ddtree.demo.stats import StepSplit, spread
from vllm_ddtree.demo.summary import VariantSummary


def _summary(name: str, kind: str, budget: int | None, tps: float, tokens: float, step: StepSplit | None, **extra) -> VariantSummary:
    fields = dict(
        variant=name, kind=kind, budget=budget, tokens_per_second=spread([tps]), tokens_per_step=spread([tokens]),
        nodes_per_step=spread([float(budget or 0)]), vs_none=spread([tps / 1000]), vs_chain=spread([tps / 500]), step_ms=step,
        stage_ms=None, bound=None, bound_step_ms=None, shape_steps=None, acceptance_per_position=[],
    )
    return VariantSummary(**{**fields, **extra})


def _result() -> ScenarioResult:
    chain = StepSplit(wall=10.0, draft=2.0, own=1.0, forward=4.0, rest=2.0, outside=1.0, rows=128.0, steps=30)
    tree = StepSplit(wall=30.0, draft=2.5, own=3.0, forward=20.0, rest=3.0, outside=1.5, rows=528.0, steps=25)
    summaries = [
        _summary("no speculation", "none", None, 1000.0, 1.0, None),
        _summary("ddtree width 1", "width1", 7, 500.0, 2.75, chain),
        _summary("ddtree default (<=32)", "default", 32, 520.0, 2.9, None),
        _summary("ddtree budget 32", "fixed", 32, 300.0, 3.7, tree, bound=spread([0.7, 0.8])),
    ]
    return ScenarioResult(Scenario("throughput", Work(((1,),) * 16, 16, 0.0, 64)), summaries, [])


def test_paragraph_numbers_come_from_the_summaries():
    text = stage_paragraph(_result())
    assert "batch 16" in text and "budget 32 takes 30.00 ms" in text
    assert "draft forward 2.50 ms (8%)" in text and "own stages (top-k, tree build, acceptance, KV compaction) 3.00 ms (10%)" in text
    assert "target forward 20.00 ms (67%)" in text and "the rest of the engine step 4.50 ms (15%)" in text
    assert "528 rows per step on average" in text and f"{20 / 528:.4f} ms per row" in text and f"{4 / 128:.4f} ms per row" in text
    assert "5.0x the chain's for 1.35x its tokens per step (3.70 vs 2.75)" in text
    assert "0.75x [0.70-0.80] the chain's tokens/s (measured: 0.60x)" in text
    assert "verifying 33 rows" in text
    assert "grows with rows, here faster than linearly (5.0x the time for 4.1x the rows here: a tree row costs 1.21x a chain row" in text


def test_growth_says_linear_only_when_the_cost_per_row_holds():
    from vllm_ddtree.demo.__main__ import growth

    chain = StepSplit(wall=10.0, draft=2.0, own=1.0, forward=4.0, rest=2.0, outside=1.0, rows=128.0, steps=30)
    tree = StepSplit(wall=30.0, draft=2.5, own=3.0, forward=16.5, rest=3.0, outside=1.5, rows=528.0, steps=25)
    assert growth(tree, chain) == "about linearly with rows (4.1x the time for 4.1x the rows here)"


def test_no_paragraph_without_a_stage_timed_chain():
    result = _result()
    without_chain = ScenarioResult(result.scenario, [s for s in result.summaries if s.kind != "width1"], [])
    assert stage_paragraph(without_chain) == ""


def test_headline_names_the_default_configuration_in_each_scenario():
    result = _result()
    latency = ScenarioResult(Scenario("latency", Work(((1,),), 1, 0.0, 64)), result.summaries, [])
    assert headline([latency, result]) == "ddtree default (<=32), tokens/s over no speculation: latency 0.52x, throughput 0.52x"


def test_plot_is_written(tmp_path):
    from vllm_ddtree.demo.__main__ import plot

    plot([_result()], str(tmp_path / "demo.png"))
    assert (tmp_path / "demo.png").stat().st_size > 0

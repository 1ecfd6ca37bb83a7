"""The interleaved harness without engines: rotation, prompts, counters, decode-step splits, summaries."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_ddtree.demo import heldout_prompts
from vllm_ddtree.demo.engines import Engine, Pass, SpecRecorder, TimedRun, Work, context_prompts, rotated, serve_interleaved, stage_timed
from vllm_ddtree.demo.side_by_side import SpecCounters
from vllm_ddtree.demo.summary import NO_SPECULATION, VariantSpec, greedy_mismatches, summarize
from vllm_ddtree.vllm.stage_times import DRAFT_FORWARD, STAGES


def test_rotation_puts_every_variant_in_every_place():
    variants = ["a", "b", "c"]
    orders = [rotated(variants, k) for k in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert rotated(variants, 4) == orders[1]


def test_every_call_of_a_pass_is_served_by_every_engine_in_a_rotating_order():
    pytest.importorskip("vllm")  # Work.calls builds vLLM's SamplingParams
    log: list[tuple[str, list[int]]] = []

    class FakeLLM:
        def __init__(self, name: str) -> None:
            self.name = name

        def generate(self, prompts, sampling, use_tqdm=False):
            log.append((self.name, [p["prompt_token_ids"][0] for p in prompts]))
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[p["prompt_token_ids"][0], 0])]) for p in prompts]

        def collective_rpc(self, method):
            return [(None, None)]  # a runner without stage times or policy

    engines = [Engine(name, FakeLLM(name), SpecRecorder()) for name in ("a", "b")]
    served = serve_interleaved(engines, Work(((1,), (2,), (3,)), 1, 0.0, 2), shift=1)
    assert log == [("b", [1]), ("a", [1]), ("a", [2]), ("b", [2]), ("b", [3]), ("a", [3])]
    for name in ("a", "b"):
        timed, token_ids, counters, shapes = served[name]
        assert token_ids == [[1, 0], [2, 0], [3, 0]] and counters == SpecCounters(0, 0, 0, ()) and shapes is None
        assert timed.seconds > 0 and timed.stages is None
    log.clear()  # a pass of one call, repeated: the repeats interleave call by call, rotating on
    served = serve_interleaved(engines, Work(((1,), (2,)), 2, 0.0, 2, repeats=3), shift=0)
    assert log == [("a", [1, 2]), ("b", [1, 2]), ("b", [1, 2]), ("a", [1, 2]), ("a", [1, 2]), ("b", [1, 2])]
    assert served["a"][1] == [[1, 0], [2, 0]] * 3 and Work(((1,), (2,), (3,)), 2, 0.0, 2).calls_per_pass == 2


def test_only_fixed_shape_ddtree_engines_time_their_stages():
    """The default config runs as users run it (no stage timer); the fixed shapes feed the breakdown."""
    ddtree = {"method": "ddtree", "model": "d", "num_speculative_tokens": 8}
    assert stage_timed({**ddtree, "ddtree_adaptive": False})
    assert stage_timed({**ddtree, "ddtree_topk": 1, "ddtree_adaptive": False})
    assert not stage_timed(ddtree) and not stage_timed({**ddtree, "ddtree_adaptive": True})
    assert not stage_timed(None) and not stage_timed({"method": "dflash", "model": "d", "num_speculative_tokens": 7, "ddtree_adaptive": False})


def test_short_prompts_are_the_heldout_snippets():
    assert context_prompts(4, 64) == heldout_prompts(4, 64)


def test_long_prompts_have_the_length_asked_and_start_differently():
    prompts = context_prompts(16, 1984)
    assert all(len(p) == 1984 for p in prompts)
    assert len({tuple(p[:256]) for p in prompts}) == 16  # no prefix-cache hits between prompts
    snippets = heldout_prompts(64, 256)
    assert prompts[1][256:512] == snippets[9]  # prompt i: snippets i, i+8, i+16, ...


def test_recorder_sums_the_spec_decode_stats_of_every_step():
    recorder = SpecRecorder()
    step = SimpleNamespace(num_drafts=2, num_draft_tokens=14, num_accepted_tokens=5, num_accepted_tokens_per_pos=[2, 2, 1])
    recorder.record(SimpleNamespace(spec_decoding_stats=step), None)
    recorder.record(SimpleNamespace(spec_decoding_stats=None), None)
    recorder.record(None, None)
    recorder.record(SimpleNamespace(spec_decoding_stats=step), None)
    assert recorder.counters() == SpecCounters(4, 28, 10, (4, 4, 2))


def _stages(seconds: float, steps: int) -> dict[str, float]:
    return {**{name: seconds for name in STAGES}, "steps": float(steps)}


def _run(
    seconds: float, tokens_per_request: int, counters: SpecCounters, stages: dict | None = None, prefill: Pass | None = None
) -> TimedRun:
    return TimedRun(
        seconds=seconds,
        token_ids=[[1] * tokens_per_request] * 2,
        counters=counters,
        stages=stages,
        shape_steps=None,
        prefill=prefill or Pass(0.0, None),
    )


def test_split_times_the_decode_steps_alone():
    # 2 requests x 11 tokens: prefill (2 first tokens), 5 decode steps of 2 requests committing 2 tokens each
    counters = SpecCounters(drafts=10, draft_tokens=70, accepted=10)
    run = _run(1.0, 11, counters, stages=_stages(0.1, 6), prefill=Pass(0.25, _stages(0.02, 1)))
    split = run.split()
    assert split.steps == 5
    assert split.wall == pytest.approx(1000 * 0.75 / 5)
    assert split.forward == pytest.approx(1000 * 0.08 / 5)
    assert split.rows == pytest.approx((10 + 70) / 5)  # one row per request and step + one per draft node
    assert run.decode_stage_ms()[DRAFT_FORWARD] == pytest.approx(16.0)
    assert _run(1.0, 11, counters).split() is None  # no stage times (vLLM's own runners)


def _spec(name: str, kind: str, budget: int | None = None) -> VariantSpec:
    return VariantSpec(name, kind, budget, None)


def _timed(tokens_per_second: list[float], stage_seconds: float | None = None) -> list[TimedRun]:
    counters = SpecCounters(drafts=10, draft_tokens=70, accepted=10)
    runs = []
    for tps in tokens_per_second:
        stages = _stages(stage_seconds, 6) if stage_seconds is not None else None
        prefill = Pass(0.0, _stages(0.0, 1)) if stage_seconds is not None else Pass(0.0, None)
        runs.append(_run(22 / tps, 11, counters, stages, prefill))
    return runs


def test_summaries_divide_inside_rounds_by_the_right_baseline():
    variants = [_spec(NO_SPECULATION, "none"), _spec("chain", "chain", 7), _spec("w1", "width1", 7), _spec("b8", "fixed", 8)]
    runs = {NO_SPECULATION: _timed([100, 200]), "chain": _timed([150, 250]), "w1": _timed([120, 260], 0.01), "b8": _timed([180, 240], 0.01)}
    greedy = {s.variant: s for s in summarize(0.0, variants, runs)}
    assert greedy["b8"].vs_none.values == pytest.approx((1.8, 1.2))
    assert greedy["b8"].vs_chain.values == pytest.approx((180 / 150, 240 / 250))
    assert greedy["b8"].bound is not None and greedy["w1"].bound is None and greedy["chain"].step_ms is None
    sampled = {s.variant: s for s in summarize(1.0, variants, runs)}
    assert sampled["b8"].vs_chain.values == pytest.approx((180 / 120, 240 / 260))  # width 1 at T > 0


def test_a_control_engine_is_measured_against_no_speculation_and_changes_no_baseline():
    """`--control`: a second engine without speculation, of its own kind, so neither baseline moves."""
    from vllm_ddtree.demo import demo_pair_paths
    from vllm_ddtree.demo.summary import build_variants

    draft = demo_pair_paths()[1]
    assert [v.kind for v in build_variants(draft, [8], 32, with_control=True)][:2] == ["none", "control"]
    assert "control" not in [v.kind for v in build_variants(draft, [8], 32)]
    variants = [_spec(NO_SPECULATION, "none"), _spec("control", "control"), _spec("w1", "width1", 7)]
    runs = {NO_SPECULATION: _timed([100, 200]), "control": _timed([90, 210]), "w1": _timed([120, 260], 0.01)}
    summaries = {s.variant: s for s in summarize(1.0, variants, runs)}
    assert summaries["control"].vs_none.values == pytest.approx((0.9, 1.05))
    assert summaries["w1"].vs_none.values == pytest.approx((1.2, 1.3))


def test_greedy_mismatches_name_variant_round_and_prompt():
    same, other = _run(1.0, 3, SpecCounters()), TimedRun(1.0, [[1, 1, 1], [1, 2, 1]], SpecCounters(), None, None, Pass(0.0, None))
    rounds = [{NO_SPECULATION: same, "b8": same}, {NO_SPECULATION: same, "b8": other}]
    assert greedy_mismatches("cell", rounds) == [{"cell": "cell", "variant": "b8", "round": 1, "first_differing_prompt": 1}]
    assert greedy_mismatches("cell", rounds[:1]) == []


def test_bench_writes_json_plots_and_the_matrix(tmp_path, monkeypatch):
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"
    spec = importlib.util.spec_from_file_location("bench", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    variants = [_spec(NO_SPECULATION, "none"), _spec("w1", "width1", 7), _spec("b8", "fixed", 8), _spec("b32", "fixed", 32)]
    runs = {NO_SPECULATION: _timed([100, 200]), "w1": _timed([120, 260], 0.01), "b8": _timed([180, 240], 0.01)}
    runs["b32"] = _timed([90, 99], 0.02)
    measured = [(bench.Cell(1, 1.0, "short"), summarize(1.0, variants, runs)), (bench.Cell(4, 1.0, "2k"), summarize(1.0, variants, runs))]
    assert bench.format_matrix(measured).splitlines()[2] == "| 1 | 1 | short | 0.80 | 1.00 | 1.21 | 0.57 |"  # per-round ratios
    paths = bench.write_outputs(str(tmp_path / "bench"), {"cells": [s.to_json() for s in measured[0][1]]}, measured)
    assert [Path(p).name for p in paths] == ["bench.json", "bench-speedup.png", "bench-tokens_per_step.png", "bench-stages.png"]
    assert json.loads(Path(paths[0]).read_text())["cells"][2]["bound"]["values"]

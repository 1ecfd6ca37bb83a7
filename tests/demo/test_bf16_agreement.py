"""bf16 runs state greedy agreement (tokens equal up to each prompt's first divergence) instead of failing;
the realistic-cost bench preset and its KV sizing; the default against the best other variant per round."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from vllm_ddtree.demo.engines import Pass, TimedRun, Work
from vllm_ddtree.demo.side_by_side import SpecCounters
from vllm_ddtree.demo.stats import spread
from vllm_ddtree.demo.summary import NO_SPECULATION, VariantSummary, common_prefix, format_agreement, greedy_agreement


def _run(token_ids: list[list[int]]) -> TimedRun:
    return TimedRun(1.0, token_ids, SpecCounters(), None, None, Pass(0.0, None))


def test_common_prefix_stops_at_the_first_difference_or_the_shorter_end():
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([], [1]) == 0


def test_agreement_counts_tokens_before_each_prompts_first_divergence():
    reference = _run([[1, 2, 3, 4], [5, 6, 7, 8]])
    diverged = _run([[1, 2, 9, 4], [5, 6, 7, 8]])  # prompt 0 parts at token 2; token 3 agreeing again does not count
    rounds = [{NO_SPECULATION: reference, "tree": reference}, {NO_SPECULATION: reference, "tree": diverged}]
    found = greedy_agreement("cell", rounds)
    assert [(a.variant, a.round) for a in found] == [("tree", 0), (NO_SPECULATION, 1), ("tree", 1)]  # the reference itself left out
    last = found[-1]
    assert (last.agreed, last.total, last.first_divergence, last.identical_prompts) == (6, 8, (2, None), 1)
    assert found[0].first_divergence == (None, None) and found[0].agreed == 8
    assert greedy_agreement("cell", [{"tree": reference}]) == []  # no reference engine: nothing to state


def test_agreement_line_names_the_worst_round_and_where_it_parted():
    reference = _run([[1, 2, 3, 4], [5, 6, 7, 8]])
    rounds = [{NO_SPECULATION: reference, "tree": reference}, {NO_SPECULATION: reference, "tree": _run([[1, 2, 9, 4], [5, 6, 7, 8]])}]
    text = format_agreement(greedy_agreement("cell", rounds))
    lines = text.splitlines()
    assert lines[0].startswith("tree") and "6/8 tokens (75.0%)" in lines[0] and "1/2 prompts identical" in lines[0]
    assert "worst of 2 rounds; range 75.0-100.0%" in lines[0] and "first divergences at tokens [2]" in lines[0]
    assert lines[1].startswith(NO_SPECULATION) and "8/8 tokens (100.0%)" in lines[1] and "first divergences" not in lines[1]


def _summary(name: str, kind: str, tps: list[float]) -> VariantSummary:
    one = spread([1.0])
    return VariantSummary(name, kind, None, spread(tps), one, one, None, None, None, None, None, None, None, [])


def test_default_is_divided_by_the_best_other_variant_of_the_same_round():
    from vllm_ddtree.demo.__main__ import vs_best_other

    summaries = [
        _summary(NO_SPECULATION, "none", [10.0, 10.0]),
        _summary("chain", "chain", [20.0, 30.0]),
        _summary("tree 8", "fixed", [25.0, 20.0]),
        _summary("default", "default", [25.0, 27.0]),
    ]
    text = vs_best_other(summaries)
    assert text.startswith("0.95x [0.90-1.00] the best of chain, tree 8 per round")  # 25/25 and 27/30
    assert vs_best_other(summaries[:1]) == ""


def _bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"
    spec = importlib.util.spec_from_file_location("bench", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


def test_realistic_preset_is_overridden_by_explicit_arguments_and_leaves_the_default_alone():
    bench = _bench()
    default = bench.parse_args([])
    assert (default.pair, default.dtype, default.control) == ("embedded", None, False)
    preset = bench.parse_args(["--realistic"])
    assert (preset.pair, preset.dtype, preset.batches, preset.temperatures, preset.contexts) == ("0.6b", "bfloat16", [1, 4, 16], [0.0, 1.0], ["short"])
    assert preset.control and preset.unseeded
    narrowed = bench.parse_args(["--realistic", "--batches", "1", "--temperatures", "0", "--budgets", "8"])
    assert (narrowed.pair, narrowed.batches, narrowed.temperatures, narrowed.budgets) == ("0.6b", [1], [0.0], [8])
    assert bench.exact_greedy_check(None) and bench.exact_greedy_check("float32") and not bench.exact_greedy_check("bfloat16")
    with pytest.raises(SystemExit):
        bench.parse_args(["--pair", "0.6b", "--target", "t", "--draft", "d"])


def test_widened_kv_cache_holds_the_sequences_in_whole_blocks_and_one_of_max_model_len(tmp_path):
    """Each sequence in whole blocks of 128 tokens (vLLM's on a CPU): sized by tokens alone, 16
    sequences of 192 tokens got 30 blocks for their 32, and the speculative engines preempted."""
    import json

    bench = _bench()
    for name, layers in (("target", 28), ("draft", 4)):
        (tmp_path / name).mkdir()
        cfg = {"num_hidden_layers": layers, "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 1024, "num_attention_heads": 16}
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    dirs = [str(tmp_path / "target"), str(tmp_path / "draft")]
    per_token = 2 * 32 * 8 * 64 * 2  # K and V, 32 layers, 8 heads of 64, bf16
    assert bench.kv_bytes_per_token(dirs, "bfloat16") == per_token
    assert bench.kv_cache_bytes("0.6b", dirs, "bfloat16", 16, 192, 1024) == 1.25 * 16 * 256 * per_token  # 320 MiB
    assert bench.kv_cache_bytes("0.6b", dirs, "bfloat16", 16, 256, 1024) == 1.25 * 16 * 256 * per_token
    assert bench.kv_cache_bytes("0.6b", dirs, "bfloat16", 1, 100, 1024) == 1.25 * 1024 * per_token  # one max_model_len
    assert bench.kv_cache_bytes("embedded", dirs, "float32", 16, 192, 1024) == 0  # the shipped pair keeps its sizes


def test_headline_names_the_realistic_scenarios_setting():
    from vllm_ddtree.demo.__main__ import Scenario, ScenarioResult, headline
    from vllm_ddtree.demo.engines import Work

    default = VariantSummary("ddtree default (<=32)", "default", 32, spread([30.0]), spread([3.0]), spread([8.0]), spread([2.5]),
                             None, None, None, None, None, None, [])
    embedded = ScenarioResult(Scenario("latency", Work(((1,),), 1, 0.0, 64)), [default], [])
    realistic = ScenarioResult(Scenario("latency", Work(((1,),), 1, 0.0, 48), "0.6b widened pair, bfloat16"), [default], [])
    assert headline([embedded, realistic]) == (
        "ddtree default (<=32), tokens/s over no speculation: latency 2.50x, latency (0.6b widened pair, bfloat16) 2.50x"
    )
    assert realistic.scenario.description.startswith("latency (0.6b widened pair, bfloat16): 1 prompts of 1 tokens served one at a time")


def test_demo_report_states_bf16_agreement_and_passes_on_it(tmp_path):
    import argparse
    import json

    from vllm_ddtree.demo.__main__ import Scenario, ScenarioResult, report

    reference = _run([[1, 2, 3, 4]])
    agreement = tuple(greedy_agreement("latency", [{NO_SPECULATION: reference, "tree": _run([[1, 2, 9, 4]])}]))
    summaries = [_summary(NO_SPECULATION, "none", [10.0, 11.0]), _summary("chain", "chain", [20.0, 22.0]),
                 _summary("default", "default", [25.0, 24.0]), _summary("tree 8", "fixed", [24.0, 25.0])]
    embedded = ScenarioResult(Scenario("latency", Work(((1,),), 1, 0.0, 64)), summaries, [])
    realistic = ScenarioResult(Scenario("latency", Work(((1,),), 1, 0.0, 48), "0.6b widened pair, bfloat16"), summaries, [], agreement)
    said: list[str] = []
    assert report([embedded, realistic], {}, str(tmp_path / "demo"), argparse.Namespace(x=1), said.append)
    text = "\n".join(said)
    assert "greedy agreement with no speculation (bfloat16: stated, not required" in text and "3/4 tokens (75.0%)" not in text
    assert "2/4 tokens (50.0%) agree" in text  # [1, 2, 9, 4] parts from [1, 2, 3, 4] at token 2
    assert "default: 1.00x [0.96-1.04] the best of chain, tree 8 per round" in text  # 25/24, 24/25
    assert "identical to plain decoding for every variant and round of the float32 scenarios (latency)" in text
    written = json.loads((tmp_path / "demo.json").read_text())
    assert written["scenarios"][1]["greedy_agreement"][0]["first_divergence"] == [2]
    assert (tmp_path / "demo.png").stat().st_size > 0

"""Method 'ddtree' under tensor parallelism 2 on CPU (multiprocess executor, one core per rank).

Every rank must reach the same accepted path, else the ranks compact their KV shards differently. A
recorder installed on every worker through `LLM.collective_rpc` keeps each rank's steps (trees, sampled
tokens, the walk's accepted paths); the test compares them rank by rank, for greedy requests (which must also
equal plain decoding) and for sampled ones (T = 1, unseeded and seeded).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN, MAX_TOKENS, prompts


def _install_recorder(worker: Any) -> None:
    runner = worker.model_runner
    runner.recorded_steps = []
    sample = runner._sample

    def recording_sample(*args: Any, **kwargs: Any) -> Any:
        out = sample(*args, **kwargs)
        step = runner.step
        # a step drawn by vLLM's sampler (no drafts, `plain_sampler_serves`) has no walk: its tokens alone;
        # a plain step (runner module docstring) has no `TreeStep` either
        if step is None:
            runner.recorded_steps.append((None, None, out.sampled_token_ids.tolist(), None))
            return out
        accepted = None if step.acceptance is None else step.acceptance.accepted_nodes.tolist()
        runner.recorded_steps.append(
            (step.tree.token_ids.tolist(), step.tree.parents.tolist(), out.sampled_token_ids.tolist(), accepted)
        )
        return out

    runner._sample = recording_sample


def _take_recorded(worker: Any) -> list:
    steps, worker.model_runner.recorded_steps = worker.model_runner.recorded_steps, []
    return steps


@pytest.fixture(scope="module", params=[False, True], ids=["fixed", "adaptive"])
def tp_engine(pair_dirs, request):
    """TP=2 engine, budget 16, fixed or adaptive (each rank times its own steps; rank 0's shape wins)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a test callable
    from vllm import LLM

    target, draft = pair_dirs["focused"]
    llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, tensor_parallel_size=2,
              distributed_executor_backend="mp", kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=64, max_num_seqs=16, seed=0,
              speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": 16,
                                  "ddtree_adaptive": request.param})
    llm.collective_rpc(_install_recorder)
    yield llm
    llm.llm_engine.engine_core.shutdown()
    mp.undo()


def _generate_on_both_ranks(llm, requests, params) -> tuple[list[list[int]], list[list]]:
    outputs = llm.generate(requests, params, use_tqdm=False)
    ranks = llm.collective_rpc(_take_recorded)
    assert len(ranks) == 2
    return [list(o.outputs[0].token_ids) for o in outputs], ranks


def test_tp2_greedy_equals_plain_and_ranks_agree(tp_engine, engine_runs):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    token_ids, (rank0, rank1) = _generate_on_both_ranks(tp_engine, prompts(), params)
    assert token_ids == engine_runs("focused", None).token_ids
    assert rank0 == rank1 and len(rank0) > 0
    assert any(max(len([n for n in path if n >= 0]) for path in accepted) > 2 for _, _, _, accepted in rank0 if accepted)


def test_tp2_sampled_ranks_reach_the_same_paths(tp_engine):
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=None if i % 2 else i) for i in range(8)]
    token_ids, (rank0, rank1) = _generate_on_both_ranks(tp_engine, prompts(), params)
    assert all(len(t) == 24 for t in token_ids)
    assert rank0 == rank1 and len(rank0) > 0


def _script_off_off_tree(worker: Any) -> None:
    """Every rank: two steps without speculation (the runner's off path: context deferred, no draft
    call), then a tree of 16, cycled."""
    from tests.e2e.scripted_budget import ScriptedBudget
    from vllm_ddtree.core import OFF, TreeShape, candidate_shapes

    runner = worker.model_runner
    runner.use_budget_policy(ScriptedBudget(candidate_shapes(16, runner.drafter.max_depth), [OFF, OFF, TreeShape(16)]))


def test_tp2_off_steps_keep_greedy_equal_to_plain_and_ranks_agree(tp_engine, engine_runs):
    """Steps without speculation under TP=2, forced (the policy's choice is broadcast from rank 0 before
    the runner decides to skip vLLM's drafting path): outputs equal plain decoding, ranks agree, and the
    trees after off steps still accept deep paths (the deferred context was stored on both ranks)."""
    from vllm import SamplingParams

    tp_engine.collective_rpc(_script_off_off_tree)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    token_ids, (rank0, rank1) = _generate_on_both_ranks(tp_engine, prompts(), params)
    assert token_ids == engine_runs("focused", None).token_ids
    assert rank0 == rank1
    assert any(max(len([n for n in path if n >= 0]) for path in accepted) > 2 for _, _, _, accepted in rank0 if accepted)

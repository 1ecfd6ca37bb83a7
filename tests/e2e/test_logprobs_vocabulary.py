"""Whole-vocabulary logprobs (logprobs=-1, prompt_logprobs=-1) and `logprob_token_ids` under method
'ddtree': what plain decoding reports.

vLLM 0.32's V1 runner (plain decoding's) serves logprobs=-1 as the top vocabulary-size logprobs of
`Sampler.gather_logprobs` (the token, then every token sorted), and only on an engine whose
`max_logprobs` allows it (-1 here; with the default 20 vLLM refuses such requests itself, whatever the
method); `logprob_token_ids` as `Sampler.gather_specific_token_logprobs` (the token, then the asked
ids). Method 'ddtree' gathers both with the same sampler methods from the logits row of the tree node
each token was drawn at, so:
- greedy: tokens, every entry's token id and value (within float tolerance) and rank equal plain
  decoding's, prompt_logprobs=-1 too (ranks up to near-ties: two tokens whose values differ by less
  than the tolerance may trade places, as they may between two batch shapes of plain decoding);
- sampled (deep trees, every token from another node): each reported value equals plain decoding's
  teacher-forced score of the same token and id (prompt + output scored with prompt_logprobs=-1).
Both ddtree batches mix the two kinds of requests: each request gets what it asked for (vLLM's own
sampler gives every row of such a batch the id rows), compared with plain decoding's batches of one
kind each. prompt_logprob_token_ids needs vLLM's V2 model runner: vLLM refuses it on these V1 engines
(on V2: tests/v2/test_v2_logprobs.py).
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import prompts

TOL = 1e-4
VOCAB = 512
MAX_TOKENS = 24
REQUESTS = prompts()


def _token_ids(i: int) -> list[int]:
    """The ids request i asks logprobs for: 1 to 4 of them (rows of different widths)."""
    return [(37 * i + 101 * k + 5) % VOCAB for k in range(1 + i % 4)]


def _params(i: int, kind: str, **kw):
    from vllm import SamplingParams

    asked = {"vocabulary": {"logprobs": -1, "prompt_logprobs": -1}, "ids": {"logprob_token_ids": _token_ids(i)}}[kind]
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **asked, **kw)


def _mixed(i: int) -> str:
    return "vocabulary" if i % 2 == 0 else "ids"


def _engine(target, spec, jobs, **llm_kwargs):
    """Outputs of one engine (max_logprobs -1) for each (requests, params) job, generated in turn; what
    admitting a prompt_logprob_token_ids request raised; and the tokens per verify step (None: none)."""
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError

    llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=2**27, max_model_len=512, max_num_seqs=16, seed=0, speculative_config=spec,
              max_logprobs=-1, disable_log_stats=False, **{"max_num_batched_tokens": 64, **llm_kwargs})
    try:
        outputs = [llm.generate(requests, params, use_tqdm=False) for requests, params in jobs]
        try:
            llm.generate(REQUESTS[:1], SamplingParams(max_tokens=2, prompt_logprob_token_ids=[[1, 2]]), use_tqdm=False)
            refusal = None
        except VLLMValidationError as error:
            refusal = error
        counts = {m.name: m.value for m in llm.get_metrics()
                  if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
        drafts = counts.get("vllm:spec_decode_num_drafts")
        return outputs, refusal, 1 + counts["vllm:spec_decode_num_accepted_tokens"] / drafts if drafts else None
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def runs(pair_dirs):
    target, draft = pair_dirs["focused"]
    fixed = {"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False}
    n = len(REQUESTS)
    greedy = {kind: [_params(i, kind, temperature=0.0) for i in range(n)] for kind in ("vocabulary", "ids")}
    (plain_vocabulary, plain_ids), _, _ = _engine(target, None, [(REQUESTS, greedy["vocabulary"]), (REQUESTS, greedy["ids"])])
    mixed_greedy = [greedy[_mixed(i)][i] for i in range(n)]
    mixed_sampled = [_params(i, _mixed(i), temperature=1.0, seed=i) for i in range(n)]
    (ddtree_greedy, ddtree_sampled), refusal, tokens_per_step = _engine(target, fixed, [(REQUESTS, mixed_greedy), (REQUESTS, mixed_sampled)])
    forced = [{"prompt_token_ids": r["prompt_token_ids"] + list(o.outputs[0].token_ids)} for r, o in zip(REQUESTS, ddtree_sampled)]
    from vllm import SamplingParams

    (scores,), _, _ = _engine(target, None, [(forced, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=-1))],
                           max_num_batched_tokens=512)
    return {"plain": {"vocabulary": plain_vocabulary, "ids": plain_ids}, "greedy": ddtree_greedy,
            "sampled": ddtree_sampled, "scores": scores, "refusal": refusal, "tokens_per_step": tokens_per_step}


def _assert_same_position(ours, theirs) -> int:
    """One position's logprobs equal: the same token ids, values within TOL, ranks equal unless a
    near-tie (another token within TOL of the value) lets them trade places. Returns the number of
    entries whose rank differs (near-ties)."""
    assert set(ours) == set(theirs), (sorted(set(ours) ^ set(theirs)))
    values = sorted((lp.logprob for lp in theirs.values()), reverse=True)
    traded = 0
    for token, lp in ours.items():
        value = theirs[token].logprob
        assert abs(lp.logprob - value) < TOL, (token, lp, theirs[token])
        if lp.rank != theirs[token].rank:
            above = sum(v > value + TOL for v in values)
            tied = sum(abs(v - value) <= TOL for v in values)
            assert above < lp.rank <= above + tied, (token, lp, theirs[token])
            traded += 1
    return traded


def _assert_same_logprobs(ours, theirs) -> int:
    assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
    assert len(ours.outputs[0].logprobs) == len(theirs.outputs[0].logprobs) == MAX_TOKENS
    return sum(_assert_same_position(a, b) for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs))


def _assert_few_near_ties(traded: int, positions: int) -> None:
    """Near-ties are rare: at most one entry in 1,000 of the whole-vocabulary positions trades its rank."""
    print(f"{traded} ranks traded in {positions} positions of {VOCAB} entries")
    assert traded * 1000 <= positions * VOCAB, f"{traded} ranks traded in {positions} positions"


def test_greedy_whole_vocabulary_and_token_id_logprobs_equal_plain_decoding(runs):
    traded = positions = 0
    for i, ours in enumerate(runs["greedy"]):
        kind = _mixed(i)
        plain = runs["plain"][kind][i]
        traded += _assert_same_logprobs(ours, plain)
        if kind == "vocabulary":
            assert all(len(position) == VOCAB for position in ours.outputs[0].logprobs)
            positions += MAX_TOKENS + len(ours.prompt_logprobs) - 1
            assert ours.prompt_logprobs[0] is None
            for a, b in zip(ours.prompt_logprobs[1:], plain.prompt_logprobs[1:], strict=True):
                assert len(a) == VOCAB
                traded += _assert_same_position(a, b)
        else:
            assert ours.prompt_logprobs is None
            for token, position in zip(ours.outputs[0].token_ids, ours.outputs[0].logprobs):
                assert set(position) == {token, *_token_ids(i)}
    _assert_few_near_ties(traded, positions)


def test_sampled_logprobs_equal_teacher_forced_scores(runs):
    traded = positions = 0
    for i, (request, ours, score) in enumerate(zip(REQUESTS, runs["sampled"], runs["scores"])):
        start = len(request["prompt_token_ids"])
        for k, (token, position) in enumerate(zip(ours.outputs[0].token_ids, ours.outputs[0].logprobs)):
            forced = score.prompt_logprobs[start + k]
            if _mixed(i) == "vocabulary":
                traded += _assert_same_position(position, forced)
                positions += 1
                continue
            assert set(position) == {token, *_token_ids(i)}
            for t in position:
                assert abs(position[t].logprob - forced[t].logprob) < TOL, (i, k, t)
    _assert_few_near_ties(traded, positions)


def test_prompt_logprob_token_ids_refused_by_vllm(runs):
    assert runs["refusal"] is not None and "prompt_logprob_token_ids" in str(runs["refusal"])


def test_trees_still_accept(runs):
    print(f"tokens per verify step (greedy and sampled batches): {runs['tokens_per_step']:.2f}")
    assert runs["tokens_per_step"] > 1.5

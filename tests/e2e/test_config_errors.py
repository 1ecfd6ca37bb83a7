"""Settings method 'ddtree' cannot serve fail when the engine is built, before any weight is loaded,
with a message that names the problem and the fix (never a crash deep inside vLLM).

Bad pairs are copies of the random synthetic pair with one config.json field changed; non-GDN hybrid,
attention-free and M-RoPE targets are config.json files alone (the check runs on vLLM's configs,
before weights would be read).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import pytest

from tests.e2e.pairs import HIDDEN, VOCAB

FIX_DRAFT = "point 'model' at the DFlash draft trained for this target"
FIX_TARGET = "serve this model without method 'ddtree'"


def _edited_pair(pair: tuple[str, str], out: str, draft: Callable[[dict], None] | None = None,
                 target: Callable[[dict], None] | None = None) -> tuple[str, str]:
    """Copy (target, draft) under out, apply the edits to their config.json; returns the new dirs."""
    dirs = []
    for src, edit in zip(pair, (target, draft)):
        dst = os.path.join(out, os.path.basename(src))
        shutil.copytree(src, dst)
        if edit is not None:
            path = os.path.join(dst, "config.json")
            with open(path) as f:
                config = json.load(f)
            edit(config)
            with open(path, "w") as f:
                json.dump(config, f)
        dirs.append(dst)
    return dirs[0], dirs[1]


def _config_only_target(out: str, kind: str) -> str:
    """A target dir holding only config.json: a tiny Mamba-attention hybrid (Jamba; Gated DeltaNet hybrids
    are served, `test_hybrid_gdn.py`), Mamba or M-RoPE model that shares the synthetic draft's vocabulary
    and hidden size."""
    from transformers import JambaConfig, MambaConfig, Qwen3Config

    common = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 4}
    if kind == "hybrid":
        config = JambaConfig(
            **common, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
            attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2, mamba_d_state=8,
            mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
        ).to_dict()
        config["architectures"] = ["JambaForCausalLM"]
    elif kind == "mamba":
        config = {**MambaConfig(**common, state_size=8).to_dict(), "architectures": ["MambaForCausalLM"]}
    else:  # M-RoPE: rotary sections over (temporal, height, width) positions, 32 rotary pairs of head_dim 64
        config = Qwen3Config(**common, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64).to_dict()
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}
        config["architectures"] = ["Qwen3ForCausalLM"]
    os.makedirs(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def _start(target: str, spec: dict) -> None:
    from vllm import LLM

    llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              distributed_executor_backend="uni", kv_cache_memory_bytes=2**26, max_model_len=256,
              speculative_config=spec)
    llm.llm_engine.engine_core.shutdown()  # only reached if the check failed to fire


@pytest.mark.parametrize(
    ("draft_edit", "message"),
    [
        (lambda c: c.update(vocab_size=VOCAB + 88), rf"draft \S+ has vocab_size {VOCAB + 88} but the target \S+ has {VOCAB}"),
        (lambda c: c.update(hidden_size=HIDDEN // 2), rf"draft \S+ has hidden_size {HIDDEN // 2} but the target \S+ has {HIDDEN}"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]), r"target_layer_ids \[1, 9\], but the target \S+ has layers 0\.\.3 only"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[-1, 2]), r"target_layer_ids \[-1, 2\], but the target \S+ has layers 0\.\.3 only"),
        (lambda c: c.pop("dflash_config"), r"architectures \['DFlashDraftModel'\] and no dflash_config"),
        (lambda c: c["dflash_config"].pop("target_layer_ids"), r"needs the draft's dflash_config\.target_layer_ids"),
        (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}),
         r"needs a draft with 1-D rotary positions, but \S+ uses M-RoPE"),
    ],
    ids=["vocab_size", "hidden_size", "layer_id_too_high", "layer_id_negative", "no_dflash_config", "no_target_layer_ids", "mrope"],
)
def test_draft_that_does_not_fit_the_target_fails_at_start(pair_dirs, tmp_path, draft_edit, message):
    target, draft = _edited_pair(pair_dirs["random"], str(tmp_path), draft=draft_edit)
    with pytest.raises(ValueError, match=message) as error:
        _start(target, {"method": "ddtree", "model": draft, "num_speculative_tokens": 4})
    assert FIX_DRAFT in str(error.value)


def test_plain_model_as_draft_fails_at_start(pair_dirs):
    target, _ = pair_dirs["random"]
    with pytest.raises(ValueError, match=r"needs a DFlash draft checkpoint as 'model'.*architectures "
                                         r"\['Qwen3ForCausalLM'\] and no dflash_config") as error:
        _start(target, {"method": "ddtree", "model": target, "num_speculative_tokens": 4})
    assert FIX_DRAFT in str(error.value)


def test_missing_draft_fails_at_start(pair_dirs):
    target, _ = pair_dirs["random"]
    with pytest.raises(ValueError, match=r"needs 'model': the DFlash draft checkpoint .* add it to speculative_config"):
        _start(target, {"method": "ddtree", "num_speculative_tokens": 4})


def test_budget_above_the_maximum_fails_at_start(pair_dirs):
    from vllm_ddtree.core.tree import MAX_BUDGET

    target, draft = pair_dirs["random"]
    with pytest.raises(ValueError, match=rf"num_speculative_tokens \(the tree budget\) >= 1 and <= {MAX_BUDGET} .*"
                                         rf"got {MAX_BUDGET + 1}; set num_speculative_tokens in that range"):
        _start(target, {"method": "ddtree", "model": draft, "num_speculative_tokens": MAX_BUDGET + 1})


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("hybrid", r"supports hybrid targets with Gated DeltaNet layers \(Qwen3NextForCausalLM, Qwen3_5ForCausalLM, "
                   r"Qwen3_5MoeForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration\) but not .*JambaForCausalLM"),
        ("mamba", r"does not support attention-free \(Mamba/SSM\) targets .*MambaForCausalLM"),
        ("mrope", r"supports M-RoPE \(multimodal rotary positions\) only in Qwen3.5/3.6's multimodal models "
                  r"\(Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration\) run as language models only, "
                  r"not .*Qwen3ForCausalLM"),
    ],
)
def test_unsupported_target_architecture_fails_at_start(pair_dirs, tmp_path, kind, message):
    target = _config_only_target(str(tmp_path / kind), kind)
    with pytest.raises(ValueError, match=message) as error:
        _start(target, {"method": "ddtree", "model": pair_dirs["random"][1], "num_speculative_tokens": 4})
    assert FIX_TARGET in str(error.value)


def test_v2_model_runner_requested_on_a_release_without_the_v2_layer_fails_at_start(pair_dirs, monkeypatch):
    from vllm_ddtree.vllm import config

    target, draft = pair_dirs["random"]
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setattr(config, "v2_runner_available", lambda: False)
    with pytest.raises(ValueError, match=r"has no V2 model runner layer for vLLM .* \(VLLM_USE_V2_MODEL_RUNNER=1\); "
                                         r"unset VLLM_USE_V2_MODEL_RUNNER \(or set it to 0\)"):
        _start(target, {"method": "ddtree", "model": draft, "num_speculative_tokens": 4})


def test_v2_model_runner_chosen_by_vllm_is_refused(pair_dirs, monkeypatch):
    """vLLM picks V2 by itself when Triton is installed or a V2-only feature is on. This machine has no
    Triton (vLLM then refuses V2 while building its configs), so the check runs directly on the config
    of a good pair with the choice forced on the config class."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ddtree.vllm.config import check_engine_config

    target, draft = pair_dirs["random"]
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 4}
    config = EngineArgs(model=target, skip_tokenizer_init=True, kv_cache_memory_bytes=2**26,
                        speculative_config=spec).create_engine_config()
    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))
    with pytest.raises(ValueError, match=r"vLLM chose its V2 model runner for this engine; set VLLM_USE_V2_MODEL_RUNNER=0"):
        check_engine_config(config)


def test_dflash2_draft_on_the_v1_model_runner_fails_at_start_naming_the_v2_runner(tmp_path, monkeypatch):
    from vllm_ddtree.demo import demo_pair_paths
    from vllm_ddtree.demo.dflash2_pair import write_dflash2_draft

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    draft = write_dflash2_draft(str(tmp_path / "dflash2"))
    with pytest.raises(ValueError, match=r"runs DFlash2 drafts .*DFlash2DraftModel.* on vLLM's V2 model runner only .*"
                                         r"set VLLM_USE_V2_MODEL_RUNNER=1 \(vLLM 0.32; vLLM 0.34 runs V2 only\)"):
        _start(demo_pair_paths()[0], {"method": "ddtree", "model": draft, "num_speculative_tokens": 4})


@pytest.mark.parametrize(
    ("scoring", "message"),
    [
        ("selector", r"ddtree_scoring 'selector' needs a DFlash2 draft \(a candidate selector\), but .* has architectures "
                     r"\['DFlashDraftModel'\]; drop ddtree_scoring or set it to 'marginal'"),
        ("paths", r"ddtree_scoring must be 'marginal' or 'selector', got 'paths'"),
    ],
)
def test_a_scoring_the_draft_does_not_have_fails_at_start(pair_dirs, scoring, message):
    target, draft = pair_dirs["random"]
    with pytest.raises(ValueError, match=message):
        _start(target, {"method": "ddtree", "model": draft, "num_speculative_tokens": 4, "ddtree_scoring": scoring})

"""The plugin: leaves plain decoding and method 'dflash' untouched, refuses other vLLM versions,
patches only through the patch utility, and fails clearly on what method 'ddtree' does not support."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.pairs import BLOCK_SIZE

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_WITHOUT_PLUGIN = """
import json, sys
from vllm import SamplingParams
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from tests.e2e.conftest import MAX_TOKENS, prompts, run_engine
target, draft = sys.argv[1:3]
params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
plain = run_engine(target, None, prompts(), params)
dflash = run_engine(target, {"method": "dflash", "model": draft, "num_speculative_tokens": __K__}, prompts(), params)
print("RESULT" + json.dumps({"backend": AttentionBackendEnum.CPU_ATTN.get_path(), "plain": plain.token_ids,
                             "dflash": dflash.token_ids, "dflash_metrics": dflash.metrics}))
""".replace("__K__", str(BLOCK_SIZE - 1))


def test_plain_and_dflash_unaffected_by_plugin(engine_runs, pair_dirs):
    """Same outputs and DFlash counters with the plugin loaded (this process) and without it
    (a fresh process with VLLM_PLUGINS set to load no plugin)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_ddtree.vllm.plugin import ATTENTION_BACKEND

    plain = engine_runs("random", None)
    dflash = engine_runs("random", ("dflash", BLOCK_SIZE - 1))
    assert AttentionBackendEnum.CPU_ATTN.get_path() == ATTENTION_BACKEND

    env = {**os.environ, "VLLM_PLUGINS": "", "PYTHONPATH": REPO_ROOT}
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_PLUGIN, *pair_dirs["random"]],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    without = json.loads(lines[-1][len("RESULT"):])
    assert without["backend"] != ATTENTION_BACKEND
    assert without["plain"] == plain.token_ids
    assert without["dflash"] == dflash.token_ids
    for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens"):
        assert without["dflash_metrics"][name] == dflash.metrics[name]


@pytest.mark.parametrize(
    ("version", "message"),
    [
        ("0.31.0", r"runs on vLLM 0\.32\.0, 0\.33\.x, 0\.34\.x only, but vLLM 0\.31\.0"),
        ("0.35.0", r"runs on vLLM 0\.32\.0, 0\.33\.x, 0\.34\.x only, but vLLM 0\.35\.0"),
    ],
)
def test_other_vllm_version_fails_at_start(monkeypatch, version, message):
    import vllm

    from vllm_ddtree.vllm import plugin
    from vllm_ddtree.vllm.patching import UnsupportedVLLMVersion

    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(UnsupportedVLLMVersion, match=message):
        plugin.register()


def test_patch_utility_refuses_double_patching():
    from vllm_ddtree.vllm.patching import Patch, apply_patch, is_patched

    class Toy:
        def greet(self) -> str:
            return "hi"

    patch = Patch(owner=Toy, name="greet", make=lambda orig: lambda self: orig(self) + "!", why="test", remove_when="never")
    apply_patch(patch)
    assert Toy().greet() == "hi!" and is_patched(Toy, "greet")
    with pytest.raises(RuntimeError, match="already patched"):
        apply_patch(patch)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"draft_sample_method": "probabilistic"}, r"\['draft_sample_method'\] are not supported with method 'ddtree'"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens \\(the tree budget\\) >= 1"),
        ({"ddtree_topk": 0}, "ddtree_topk must be an integer >= 1"),
        ({"ddtree_adaptive": "yes"}, "ddtree_adaptive must be true or false"),
    ],
)
def test_bad_ddtree_config_fails_before_engine_start(pair_dirs, extra, message):
    from vllm import LLM

    target, draft = pair_dirs["random"]
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 4, **extra}
    with pytest.raises(ValueError, match=message):
        LLM(model=target, skip_tokenizer_init=True, speculative_config=spec)


def test_async_scheduling_request_fails_clearly(pair_dirs):
    from vllm import LLM

    target, draft = pair_dirs["random"]
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="does not support async scheduling"):
        LLM(model=target, skip_tokenizer_init=True, speculative_config=spec, async_scheduling=True)


@pytest.mark.parametrize("style", ["speculative_config", "spec_flags"])
def test_ddtree_request_becomes_dflash_config_with_forced_settings(pair_dirs, style):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ddtree.vllm.config import WORKER_CLS

    target, draft = pair_dirs["random"]
    if style == "speculative_config":
        spec = {"speculative_config": {"method": "ddtree", "model": draft, "num_speculative_tokens": 5, "ddtree_topk": 3}}
    else:
        spec = {"spec_method": "ddtree", "spec_model": draft, "spec_tokens": 5}
    config = EngineArgs(model=target, skip_tokenizer_init=True, kv_cache_memory_bytes=2**26, **spec).create_engine_config()
    assert config.speculative_config.method == "dflash"
    assert config.speculative_config.num_speculative_tokens == 5
    topk = 3 if style == "speculative_config" else None
    assert config.additional_config["ddtree"] == {"budget": 5, "topk": topk, "adaptive": True, "scoring": None}
    assert config.parallel_config.worker_cls == WORKER_CLS
    assert config.scheduler_config.async_scheduling is False

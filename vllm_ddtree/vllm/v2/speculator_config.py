"""Method 'ddtree' as a custom speculative method of vLLM 0.34 (docs/v2_runner.md, D14): the plugin
registers `DDTreeSpeculatorConfig` by name (`plugin.register_speculative_method`, where vLLM has the
registry), so `speculative_config={"method": "ddtree", ...}` reaches vLLM as custom method 'ddtree' on
DFlash's set-up (`base_method` "dflash": vLLM's DFlash draft checkpoint handling, KV lookahead and
hidden-state plumbing) and vLLM's V2 runner builds our `DDTreeSpeculator` itself. The engine-args patch
still rewrites what the registry does not cover (our worker, whose runner verifies trees; synchronous
scheduling; the prefix-cache block drop) and hands the `ddtree_*` options in `speculator_options`.

A config module: vLLM imports it in every process, so it names the speculator by its qualified name and
imports nothing of it. Importable only where vLLM has `DFlashSpeculatorConfig` (0.34).
"""

from __future__ import annotations

from typing import ClassVar

from vllm.v1.worker.gpu.spec_decode.dflash.config import DFlashSpeculatorConfig


class DDTreeSpeculatorConfig(DFlashSpeculatorConfig):
    """DFlash's config with our speculator; `speculator_options` carries the `ddtree_*` keys (read by
    `config.py`, which also writes them to `additional_config["ddtree"]` for every process)."""

    speculator_class: ClassVar[str | None] = "vllm_ddtree.vllm.v2.speculator.DDTreeSpeculator"
    supported_options: ClassVar[frozenset[str]] = frozenset({"speculator_options"})
    supports_watermarking: ClassVar[bool] = False  # refused on the V2 layer (`config._check_v2_engine`)

"""Tensor-parallel all-reduce time of one DDTree verify step (the communication term of docs/scaling.md).

Megatron-style tensor parallelism (what vLLM uses) ends every decoder layer's attention (o_proj) and MLP
(down_proj) with an all-reduce of the layer's activations: [tokens, hidden] in the model dtype. A verify
step of R requests with a tree budget B runs tokens = R * (B + 1), so per step

    T_ar = allreduces_per_layer * num_layers * (latency + 2 (tp - 1) / tp * tokens * hidden * dtype_bytes / bandwidth)

(ring all-reduce: each GPU sends and receives 2 (tp - 1) / tp of the message; `bandwidth` is what one
GPU achieves per direction, `latency` the fixed cost of one small all-reduce). Link figures and their
sources are in docs/scaling.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkModel:
    """An all-reduce fabric: achieved bytes/s per GPU per direction, and seconds per all-reduce at zero size."""

    name: str
    bandwidth: float
    latency: float


NVLINK4 = LinkModel("NVLink 4 + NVSwitch (H100/H200 SXM, 8 GPUs)", bandwidth=370e9, latency=10e-6)
"""450 GB/s per direction line rate; NCCL reaches ~370 GB/s after protocol overhead (docs/scaling.md)."""
PCIE5_X16 = LinkModel("PCIe Gen5 x16", bandwidth=50e9, latency=25e-6)
"""~63 GB/s per direction line rate (32 GT/s x 16 lanes, 128b/130b); ~50 GB/s achieved at best."""


def allreduce_seconds(message_bytes: float, tp: int, link: LinkModel) -> float:
    """Ring all-reduce of `message_bytes` over `tp` GPUs; 0 without tensor parallelism."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if tp == 1:
        return 0.0
    return link.latency + 2 * (tp - 1) / tp * message_bytes / link.bandwidth


def verify_allreduce_seconds(
    batch: int,
    budget: int,
    hidden_size: int,
    num_layers: int,
    tp: int,
    link: LinkModel,
    dtype_bytes: int = 2,
    allreduces_per_layer: int = 2,
) -> float:
    """All-reduce seconds of one verify step: `batch` requests x (budget + 1) tree tokens each."""
    tokens = batch * (budget + 1)
    return allreduces_per_layer * num_layers * allreduce_seconds(tokens * hidden_size * dtype_bytes, tp, link)

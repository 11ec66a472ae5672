"""Model FLOPs utilisation (MFU): the FLOPs a training step's documents need, over what the accelerators could do.

MFU counts what the model needs, not what an implementation runs: per token, 2 FLOPs per weight it multiplies
forward (attention projections, the MLP, for a mixture of experts the router and the experts each token is routed to,
the LM head) and twice that backward; per causal token pair of a document, attention's ``QK^T`` and ``AV``, forward
and backward. Packed documents attend only within themselves, so the attention term is per document. What the model
does not need is not counted: recomputation under activation checkpointing, padding, frozen models' forwards (a
reference policy), communication; MFU is what they cost. The peak is the accelerator's dense bf16 throughput, read
from its name (``HF_ODC_PEAK_TFLOPS`` sets it for another device).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._env import env, parse_positive
from .cost import AttentionCost

__all__ = ["PEAK_BF16_TFLOPS", "mfu", "peak_flops", "training_flops"]

PEAK_BF16_TFLOPS: dict[str, float] = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "GH200": 989.4,
    "H100": 989.4,  # SXM
    "H200": 989.4,
    "B200": 2250.0,
    "A100": 312.0,
}
"""Dense bf16 TFLOP/s by a part of the device's name, the more specific first (the vendors' data sheets)."""


def peak_flops(device_name: str) -> float | None:
    """FLOP/s of one device called ``device_name`` (``torch.cuda.get_device_name()``): ``HF_ODC_PEAK_TFLOPS`` if
    set, else from :data:`PEAK_BF16_TFLOPS`; ``None`` for a device it does not know (no MFU is reported)."""
    override = env("PEAK_TFLOPS")
    if override is not None:
        return parse_positive(override, "HF_ODC_PEAK_TFLOPS", "TFLOP/s") * 1e12
    for part, tflops in PEAK_BF16_TFLOPS.items():
        if part in device_name:
            return tflops * 1e12
    return None


def training_flops(documents: Iterable[int], config: Any) -> float:
    """FLOPs of a forward and backward over documents of these lengths (tokens) for a model of ``config`` (a
    transformers config or a mapping, as :meth:`AttentionCost.from_config` takes): three times the forward's."""
    return 3.0 * sum(AttentionCost.from_config(config)(list(documents)))


def mfu(flops: float, seconds: float, devices: int, peak: float) -> float:
    """The fraction of ``devices`` accelerators' ``peak`` FLOP/s that ``flops`` of work in ``seconds`` used."""
    return flops / (seconds * devices * peak) if seconds > 0 else 0.0

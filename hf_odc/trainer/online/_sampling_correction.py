"""TRL's importance-sampling correction of vLLM's rollouts (``vllm_importance_sampling_correction``), on packed
rollouts.

vLLM samples from its own kernels' distribution, not exactly the trained policy's, so TRL reweights each completion
token's loss by ``exp(old - sampling)`` (the policy's log-probability before the update over vLLM's), per token or
per sequence, truncated or masked outside ``[clip_min, clip_max]``. TRL computes it while scoring, from the old
log-probabilities that an ODC trainer defers to its packed, balanced pass; so here it is computed from each packed
microbatch's loss inputs once those are in, and its metrics are computed over the whole generation batch, as one
process holding it would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

_SEQUENCE_MODES = ("sequence_mask", "sequence_truncate")
_TRUNCATE_MODES = ("sequence_truncate", "token_truncate")
_MASK_MODES = ("sequence_mask", "token_mask")
METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)
"""TRL's names for the correction's metrics, logged once per generation batch."""


def importance_sampling_ratio(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor | None,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """TRL's ratio for ``(k, T)`` rollouts: ``(k, T)`` in the token modes, ``(k, 1)`` in the sequence modes.

    A token vLLM could not score (NaN) counts as no difference, as in TRL."""
    if sampling_logps is None:
        raise ValueError(
            "vllm_importance_sampling_correction needs the generator's per-token log-probabilities (a rollout_func "
            "must return them as `logprobs`); set vllm_importance_sampling_correction=False otherwise."
        )
    difference = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode in _SEQUENCE_MODES:
        difference = difference.sum(-1, keepdim=True)
    ratio = torch.exp(difference)
    if mode in _TRUNCATE_MODES:
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode in _MASK_MODES:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"Unknown vllm_importance_sampling_mode {mode!r}.")


def local_statistics(microbatches: Sequence[dict[str, Any]], ratio_of: Any, mode: str) -> torch.Tensor:
    """This rank's share of the metrics over its packed ``microbatches`` (their loss inputs, old log-probabilities
    in): the sums, counts and extremes :func:`metrics` reduces after one gather. ``ratio_of(inputs)`` is the ratio of
    one microbatch from its ``old_logps``, ``sampling_logps`` and ``mask`` (on the CPU here)."""
    delta_sum = delta_count = ratio_sum = ratio_count = 0.0
    delta_max, ratio_min, ratio_max = -math.inf, math.inf, -math.inf
    for microbatch in microbatches:
        inputs = {key: microbatch["loss"][key] for key in ("old_logps", "sampling_logps", "mask")}
        inputs = {key: None if value is None else value.float().cpu() for key, value in inputs.items()}
        ratio = ratio_of(inputs)
        mask = inputs["mask"].bool()
        delta = (inputs["old_logps"] - inputs["sampling_logps"]).abs()
        delta = delta[mask & ~torch.isnan(delta)]
        ratio = ratio.flatten() if mode in _SEQUENCE_MODES else ratio[mask]
        if delta.numel():
            delta_sum, delta_count = delta_sum + float(delta.sum()), delta_count + delta.numel()
            delta_max = max(delta_max, float(delta.max()))
        if ratio.numel():
            ratio_sum, ratio_count = ratio_sum + float(ratio.sum()), ratio_count + ratio.numel()
            ratio_min, ratio_max = min(ratio_min, float(ratio.min())), max(ratio_max, float(ratio.max()))
    values = [delta_sum, delta_count, delta_max, ratio_sum, ratio_count, ratio_min, ratio_max]
    return torch.tensor(values, dtype=torch.float64)


def metrics(gathered: torch.Tensor) -> dict[str, float]:
    """TRL's metrics (:data:`METRICS`) from every rank's :func:`local_statistics`, ``(world_size, 7)``: token means
    and extremes over the whole generation batch (0 where it has no token, as TRL)."""
    delta_sum, delta_count, ratio_sum, ratio_count = (float(gathered[:, i].sum()) for i in (0, 1, 3, 4))
    delta_max, ratio_min, ratio_max = (float(gathered[:, 2].max()), float(gathered[:, 5].min()),
                                       float(gathered[:, 6].max()))  # fmt: skip
    values = [
        delta_sum / delta_count if delta_count else 0.0,
        delta_max if delta_count else 0.0,
        ratio_min if ratio_count else 0.0,
        ratio_sum / ratio_count if ratio_count else 0.0,
        ratio_max if ratio_count else 0.0,
    ]
    return dict(zip(METRICS, values, strict=True))

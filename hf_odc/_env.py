"""hf_odc's environment variables: one prefix, ``HF_ODC_``, one variable per setting, parsed in one place.

An explicit argument always wins; the variable is the fallback, the way Accelerate's plugins read ``FSDP_*``.

| variable | setting |
| --- | --- |
| ``HF_ODC_ENABLED`` | run with ODC (``ODCPlugin.enabled``, ``ODCSFTConfig.odc``) |
| ``HF_ODC_TIMEOUT`` | seconds a minibatch barrier waits for a live peer (``hf_odc.enable``, the plugin, the configs) |
| ``HF_ODC_RESHARD_AFTER_FORWARD`` | FSDP2's ``reshard_after_forward`` for the layers hf_odc shards |
| ``HF_ODC_TRANSPORT`` | the transport by name (``hf_odc.kernels.TRANSPORTS``); unset: the device's |
| ``HF_ODC_SHARD_SIZE`` | ranks per shard group, replicated across groups (hybrid ODC); unset: a host's ranks |
| ``HF_ODC_HOST_ID`` | tests only: ranks with different values are different hosts (``kernels.transports.hosts``) |
| ``HF_ODC_SCATTER_PROGRAMS`` | cap on the GPU accumulate kernel's programs (0: uncapped), a tuning knob |
| ``HF_ODC_PEAK_TFLOPS`` | a device's peak dense bf16 TFLOP/s, for MFU where ``hf_odc.packing.flops`` lacks it |
| ``HF_ODC_PROG`` | the program the example scripts' one-line errors name (``hf-odc sft`` sets it for its processes) |
"""

from __future__ import annotations

import math
import os

PREFIX = "HF_ODC_"
_RENAMED = ("ODC_ENABLED", "ODC_TIMEOUT", "ODC_RESHARD_AFTER_FORWARD")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env(name: str) -> str | None:
    """The value of ``HF_ODC_<name>``, or ``None`` when unset or empty; refuses the old ``ODC_*`` spellings."""
    for old in _RENAMED:
        if os.environ.get(old):
            raise ValueError(f"{old} is now {PREFIX}{old.removeprefix('ODC_')}: rename the variable.")
    return os.environ.get(PREFIX + name) or None


def parse_bool(value: str | bool, name: str) -> bool:
    """``value`` as a bool, accepting the spellings environment variables use; a clear error for anything else."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name} must be a boolean (1/0, true/false, yes/no, on/off), got {value!r}.")


def parse_seconds(value: str | float, name: str) -> float:
    """``value`` as a positive, finite number of seconds; a clear error for anything else."""
    return parse_positive(value, name, "seconds")


def parse_positive(value: str | float, name: str, unit: str) -> float:
    """``value`` as a positive, finite number (of ``unit``, as errors say); a clear error for anything else."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of {unit}, got {value!r}.") from None
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be positive and finite, got {number}.")
    return number


def parse_shard_size(value: str | int | None) -> int | None:
    """``value`` as a positive number of ranks per shard group (``None`` stays ``None``); a clear error otherwise."""
    if value is None:
        return None
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1 or str(size) != str(value).strip():
        raise ValueError(
            f"The shard size (odc_shard_size / {PREFIX}SHARD_SIZE) must be a positive integer, got {value!r}."
        )
    return size


def timeout_seconds(timeout: float | str | None, default: float) -> float:
    """``timeout`` if given, else ``HF_ODC_TIMEOUT``, else ``default``; validated."""
    if timeout is None:
        timeout = env("TIMEOUT")
    return default if timeout is None else parse_seconds(timeout, f"timeout / {PREFIX}TIMEOUT")

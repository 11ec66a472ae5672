"""``ODCPlugin``: the settings of On-Demand Communication, as an Accelerate-style plugin dataclass.

Why a plugin object and not an Accelerate config key: Accelerate's yaml rejects unknown top-level keys, silently drops
unknown ``fsdp_config`` keys, and has no hook after ``prepare``. So ODC's settings live in this dataclass (each field
falls back to an ``HF_ODC_*`` environment variable, the way Accelerate's own plugins read ``FSDP_*``; see
:mod:`hf_odc._env`), and what is done with them lives in :class:`~hf_odc.accelerate_plugin.ODCRuntime`. Building one
sets one thing in the process, its ODC timeout (:func:`hf_odc.liveness.heartbeat.set_timeout`): a trainer's config
builds its plugin before TrainingArguments creates the process group, the first place the command line's timeout is
known, so that it bounds a rank's silence during startup too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._env import env, parse_bool, parse_shard_size
from ..kernels import TRANSPORTS
from ..liveness import DEFAULT_TIMEOUT_S, heartbeat
from .parallelism import sequence_parallel_size

__all__ = ["ODCPlugin", "odc_field"]

_FIELDS = {
    "enabled": {
        "help": "Run each rank's microbatches with On-Demand Communication (ranks meet once per minibatch). False "
        "runs plain FSDP2 (the baseline). Unset: HF_ODC_ENABLED, default true."
    },
    "timeout": {
        "help": f"Seconds a rank waits for another (minibatch barriers, every collective around them) before naming "
        f"it in an error. Unset: HF_ODC_TIMEOUT, default {DEFAULT_TIMEOUT_S:g}."
    },
    "reshard_after_forward": {
        "help": "FSDP2's reshard_after_forward for the layers hf_odc shards. Unset: HF_ODC_RESHARD_AFTER_FORWARD, "
        "then the Accelerate FSDP config, then true."
    },
    "transport": {
        "help": "ODC's transport by name. Unset: HF_ODC_TRANSPORT, else the one for the model's device.",
        "choices": list(TRANSPORTS),
    },
    "shard_size": {
        "help": "Ranks per shard group, replicated across groups (one all-reduce per minibatch). Unset: "
        "HF_ODC_SHARD_SIZE, else a host's ranks."
    },
}


def odc_field(setting: str) -> Any:
    """The dataclass field of ODC's ``setting`` (a field of :class:`ODCPlugin`), unset by default, with its help and
    choices: declared once, for the plugin and for the trainers' configs (``odc_timeout`` is ``odc_field("timeout")``),
    which build their plugin from it."""
    return field(default=None, metadata=_FIELDS[setting])


@dataclass
class ODCPlugin:
    """Settings of On-Demand Communication for one model; validated on construction.

    Args:
        enabled (`bool`, *optional*):
            Run each minibatch with ODC. ``False``: the sharded model stays plain FSDP2 (collectives per layer), the
            fair baseline. ``None`` reads ``HF_ODC_ENABLED`` (default ``True``).
        timeout (`float`, *optional*):
            Seconds a minibatch barrier waits for a live peer before raising ``hf_odc.PeerFailureError`` (a dead
            peer is reported at once), and the process's ODC timeout from now on. ``None`` reads ``HF_ODC_TIMEOUT``,
            else ``hf_odc.liveness.DEFAULT_TIMEOUT_S``.
        reshard_after_forward (`bool`, *optional*):
            FSDP2's option for the layers hf_odc shards. ``None`` reads ``HF_ODC_RESHARD_AFTER_FORWARD``, then the
            Accelerate FSDP config (``fsdp_reshard_after_forward``), then ``True``.
        transport (`str`, *optional*):
            The transport ODC reads and pushes through, a name of ``hf_odc.kernels.TRANSPORTS``. ``None`` reads
            ``HF_ODC_TRANSPORT``, else the one for the model's device.
        shard_size (`int`, *optional*):
            Ranks per shard group. Parameters are sharded within a group and replicated across groups (hybrid ODC:
            one-sided inside a group, one all-reduce across replicas per minibatch). A group must lie within one
            host. ``None`` reads ``HF_ODC_SHARD_SIZE``, else a host's ranks (every rank when the job runs on one host).
        sp_size (`int`, *optional*):
            Ranks per sequence-parallel group: documents longer than a microbatch are split over the ranks of one
            group, which attend together (:mod:`hf_odc.kernels.ulysses`). ``None`` reads the Accelerate config's
            ``parallelism_config`` as ``accelerate launch`` exports it (:func:`~hf_odc.accelerate_plugin.
            sequence_parallel_size`), else 1 (none).
    """

    enabled: bool | None = odc_field("enabled")
    timeout: float | None = odc_field("timeout")
    reshard_after_forward: bool | None = odc_field("reshard_after_forward")
    transport: str | None = odc_field("transport")
    shard_size: int | None = odc_field("shard_size")

    sp_size: int | None = field(
        default=None,
        metadata={"help": "Ranks per sequence-parallel group (default: the Accelerate config's parallelism_config)."},
    )

    def __post_init__(self) -> None:
        enabled = self.enabled if self.enabled is not None else env("ENABLED") or "true"
        self.enabled = parse_bool(enabled, "ODCPlugin.enabled / HF_ODC_ENABLED")
        self.timeout = heartbeat.set_timeout(self.timeout)
        reshard = self.reshard_after_forward
        if reshard is None:
            reshard = env("RESHARD_AFTER_FORWARD")
        if reshard is not None:
            reshard = parse_bool(reshard, "ODCPlugin.reshard_after_forward / HF_ODC_RESHARD_AFTER_FORWARD")
        self.reshard_after_forward = reshard
        self.transport = self.transport if self.transport is not None else env("TRANSPORT")
        if self.transport is not None and self.transport not in TRANSPORTS:
            raise ValueError(
                f"ODCPlugin.transport / HF_ODC_TRANSPORT must be one of {sorted(TRANSPORTS)}, got {self.transport!r}."
            )
        self.shard_size = parse_shard_size(self.shard_size if self.shard_size is not None else env("SHARD_SIZE"))
        if self.sp_size is None:
            self.sp_size = sequence_parallel_size()
        if isinstance(self.sp_size, bool) or not isinstance(self.sp_size, int) or self.sp_size < 1:
            raise ValueError(f"ODCPlugin.sp_size must be a positive integer, got {self.sp_size!r}.")

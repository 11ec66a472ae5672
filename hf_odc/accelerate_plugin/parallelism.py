"""Accelerate's ``parallelism_config``, taken over: ``sp_size`` is honoured as sequence parallelism inside ODC, what
ODC cannot honour is refused in one line.

Accelerate reads the setting from two places: a ``ParallelismConfig`` given to the ``Accelerator`` (the trainers'
``parallelism_config`` argument), or, without one, what ``accelerate launch`` exported from the yaml's
``parallelism_config`` section (``ACCELERATE_USE_PARALLELISM_CONFIG`` and ``PARALLELISM_CONFIG_*``). Left to
Accelerate, the setting would build its own device mesh, and on CPU (``MULTI_CPU``) the ``Accelerator`` refuses it.
hf_odc reads it itself, as it reads the FSDP settings (:mod:`hf_odc.accelerate_plugin.sharding`), and the trainers
build their ``Accelerator`` without it (:func:`accelerate_without_parallelism`), so it works on CPU and GPU alike.

Of its sizes only ``sp_size`` means something under ODC: the ranks form groups of ``sp_size`` that split documents
longer than a microbatch (:mod:`hf_odc.packing.sequence_parallel`, :mod:`hf_odc.kernels.ulysses`). Its backend
(``sp_backend``) names DeepSpeed's implementation, which hf_odc's replaces, so any value is taken; ``sp_seq_length``
does not apply (each document is split by its own length) and ``sp_attn_implementation`` can only be its default,
``"sdpa"`` (hf_odc attends with its packed attention, SDPA per document): others are refused, as are ring
attention (``cp_size``), tensor parallelism (``tp_size``) and data-parallel sizes (hf_odc shards over every rank of a
host; ``odc_shard_size`` sets replicas).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from .._env import parse_bool

__all__ = ["accelerate_without_parallelism", "parallelism_config_from", "sequence_parallel_size"]

_LAUNCHED = "ACCELERATE_USE_PARALLELISM_CONFIG"
_PREFIX = "PARALLELISM_CONFIG_"
_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
_SEQUENCE_HANDLER = ("sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation")


def sequence_parallel_size(config: Any = None) -> int:
    """The sequence-parallel group size Accelerate's settings ask for: ``config``'s (a ``ParallelismConfig``, or what
    :func:`parallelism_config_from` takes), else, under ``accelerate launch`` with a ``parallelism_config`` in its
    yaml, the launcher's; 1 when neither says. Raises ``ValueError`` (one line, naming what to change) for a setting
    ODC cannot honour."""
    config = parallelism_config_from(config)
    if config is not None:
        handler = getattr(config, "sp_handler", None)
        values = {name: getattr(config, name, None) for name in _SIZES}
        values |= {name: getattr(handler, name, None) for name in _SEQUENCE_HANDLER}
        return _checked(values, "ParallelismConfig")
    if parse_bool(os.environ.get(_LAUNCHED, "false"), _LAUNCHED):
        values = {name: os.environ.get(_PREFIX + name.upper()) for name in (*_SIZES, *_SEQUENCE_HANDLER)}
        return _checked(values, "the Accelerate config's parallelism_config")
    return 1


def parallelism_config_from(value: Any) -> Any:
    """``value`` as Accelerate's ``ParallelismConfig``: one as it is, or a mapping, or its JSON text (what a command
    line's ``--parallelism_config '{"sp_size": 2}'`` gives), whose keys are the yaml's (``parallelism_config_sp_size``)
    or the dataclass's (``sp_size``), the sequence-parallel handler's included. Anything else is refused in one
    line."""
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    if value is None or isinstance(value, ParallelismConfig):
        return value
    example = "a JSON object such as '{\"sp_size\": 2}'"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"parallelism_config must be {example}, got {value!r}.") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"parallelism_config must be a ParallelismConfig or {example}, got {value!r}.")
    fields = {str(key).removeprefix("parallelism_config_"): item for key, item in value.items()}
    known = {"dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend", "sp_size", "sp_backend"}
    unknown = sorted(set(fields) - known - set(_SEQUENCE_HANDLER))
    if unknown:
        raise ValueError(f"parallelism_config has no key {', '.join(unknown)}; hf_odc honours sp_size.")
    handler = {name: fields.pop(name) for name in _SEQUENCE_HANDLER if name in fields}
    if handler:
        fields["sp_handler"] = DeepSpeedSequenceParallelConfig(**handler)
    return ParallelismConfig(**fields)


def _checked(values: dict[str, Any], source: str) -> int:
    sizes = {name: _size(values[name], name, source) for name in _SIZES}
    if sizes["cp_size"] > 1:
        raise ValueError(
            f"{source}: cp_size={sizes['cp_size']} (ring attention) is not supported by hf_odc; use "
            f"sp_size={sizes['cp_size']} instead (Ulysses sequence parallelism, which hf_odc runs inside ODC)."
        )
    for name, alternative in (
        ("tp_size", "hf_odc shards parameters with FSDP2 over every rank"),
        ("dp_replicate_size", "set odc_shard_size for replicas"),
        ("dp_shard_size", "hf_odc shards over every rank of a host; set odc_shard_size for another group size"),
    ):
        if sizes[name] > 1:
            raise ValueError(
                f"{source}: {name}={sizes[name]} is not supported by hf_odc ({alternative}); leave it at 1 and use "
                "sp_size to split long documents over ranks."
            )
    if values["sp_seq_length"] not in (None, "None"):
        raise ValueError(
            f"{source}: sp_seq_length={values['sp_seq_length']} does not apply to hf_odc, which splits each document "
            "by its own length; leave it unset."
        )
    if values["sp_attn_implementation"] not in (None, "None", "sdpa"):
        raise ValueError(
            f"{source}: sp_attn_implementation={values['sp_attn_implementation']!r} does not apply to hf_odc, whose "
            "sequence parallelism runs in its own packed attention ('odc_packed', SDPA per document); leave it unset "
            "or 'sdpa'."
        )
    variable = values["sp_seq_length_is_variable"]
    if variable is not None and not parse_bool(variable, "sp_seq_length_is_variable"):
        raise ValueError(
            f"{source}: sp_seq_length_is_variable=false does not apply to hf_odc, which splits each document by its "
            "own length; leave it unset."
        )
    return sizes["sp_size"]


def _size(value: Any, name: str, source: str) -> int:
    """A size of the parallelism config, 1 when unset; a positive integer, else a one-line ``ValueError``."""
    if value is None or value == "":
        return 1
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if isinstance(value, bool) or size < 1 or str(size) != str(value).strip():
        raise ValueError(f"{source}: {name} must be a positive integer, got {value!r}.")
    return size


@contextlib.contextmanager
def accelerate_without_parallelism(args: Any) -> Iterator[None]:
    """While the block runs (the ``Accelerator`` being built), Accelerate sees no parallelism config: neither
    ``args.parallelism_config`` (a ``TrainingArguments``) nor the launcher's environment; both are restored after.
    hf_odc honours it itself (:func:`sequence_parallel_size`)."""
    given = args.parallelism_config
    launched = os.environ.get(_LAUNCHED)
    args.parallelism_config = None
    if launched is not None:
        os.environ[_LAUNCHED] = "false"
    try:
        yield
    finally:
        args.parallelism_config = given
        if launched is not None:
            os.environ[_LAUNCHED] = launched

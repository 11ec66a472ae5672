"""How ``hf-odc sft`` and its siblings start the processes: the Accelerate config (hf_odc's own, shipped in the package,
or the user's), read and checked here, and Accelerate's launcher (torchrun) run in this process, whose failures end in
one line and the workers' own exit status.

* **The config.** :func:`read_accelerate_config` takes a path or the name of a shipped config (:data:`SHIPPED`:
  ``odc``, the GPU one; ``odc_cpu``, the gloo one) and refuses in one line what Accelerate would refuse with a
  traceback (a missing file, YAML that does not parse, an unknown key). It also takes the ODC settings there, the
  plugin's natural home, at the top level (:data:`ODC_KEYS`): they reach the processes as their ``HF_ODC_*``
  variables (:mod:`hf_odc._env`), which the configs read where the flag is unset, and Accelerate gets a copy of the
  file without them. Its ``fsdp_config`` is what Accelerate exports to the processes as ``FSDP_*`` variables
  (:meth:`AccelerateConfig.fsdp_variables`), so that the training configs' own checks of them run before the launch.
* **The launch.** :func:`launch` runs ``accelerate launch`` in this process, as TRL's ``trl`` command does, so that
  torchrun's agent is this process: its report of a failed worker (forty lines ending in a link, after the worker's
  own line) is replaced by one line, or by nothing when the worker already said what was wrong (exit status 2, the
  examples' one-line errors), and the command exits with the worker's status, not torchrun's 1. Once a worker has
  ended, a worker still stopped (SIGSTOP) is ended at once rather than after torchrun's 30 s of grace, so that a run
  whose peer named a stopped rank ends within the ODC timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .._env import PREFIX, parse_bool, parse_seconds, parse_shard_size
from ..kernels.transports import TRANSPORTS
from ..liveness import procfs

SHIPPED = ("odc", "odc_cpu")
"""The Accelerate configs hf_odc ships (``hf_odc/cli/accelerate_configs/<name>.yaml``; ``examples/`` links to them):
FSDP2 on one host, ``odc`` for GPUs (bf16), ``odc_cpu`` for CPU processes (gloo, fp32)."""

ODC_KEYS = {"odc": "ENABLED", "odc_timeout": "TIMEOUT", "odc_transport": "TRANSPORT", "odc_shard_size": "SHARD_SIZE"}
"""The ODC keys an Accelerate config may hold for ``hf-odc``, each named as the training configs' field (and flag),
with the ``HF_ODC_*`` variable that carries it to the processes."""

_TORCHRUN_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")


def shipped_config(name: str) -> Path:
    """The path of the shipped Accelerate config ``name`` (one of :data:`SHIPPED`)."""
    return Path(str(resources.files(__package__) / "accelerate_configs" / f"{name}.yaml"))


def default_config_name(cuda: bool) -> str:
    """The shipped config for this machine: ``odc`` with CUDA devices, else ``odc_cpu``."""
    return "odc" if cuda else "odc_cpu"


@dataclass
class AccelerateConfig:
    """An Accelerate config as ``hf-odc`` read it.

    Args:
        source: The file the user named (or the shipped one).
        settings: Its keys, the ODC ones taken out.
        odc_variables: The ``HF_ODC_*`` variables its ODC keys set.
        shipped: Whether it is one of :data:`SHIPPED`.
    """

    source: Path
    settings: dict[str, Any]
    odc_variables: dict[str, str] = field(default_factory=dict)
    shipped: bool = False

    @property
    def num_processes(self) -> int | None:
        value = self.settings.get("num_processes")
        return value if isinstance(value, int) else None

    @property
    def use_cpu(self) -> bool:
        return bool(self.settings.get("use_cpu"))

    def fsdp_variables(self) -> dict[str, str]:
        """The ``FSDP_*`` variables Accelerate exports to the processes from ``fsdp_config`` (``fsdp_offload_params:
        true`` becomes ``FSDP_OFFLOAD_PARAMS=true``)."""
        if self.settings.get("distributed_type") != "FSDP":
            return {}
        return {
            "FSDP_" + key.removeprefix("fsdp_").upper(): str(value).lower() if isinstance(value, bool) else str(value)
            for key, value in (self.settings.get("fsdp_config") or {}).items()
        }

    @contextlib.contextmanager
    def file_for_accelerate(self) -> Iterator[Path]:
        """Inside: a file Accelerate reads, the source itself, or a copy without the ODC keys (removed after)."""
        if not self.odc_variables:
            yield self.source
            return
        with tempfile.NamedTemporaryFile("w", prefix="hf_odc_accelerate_", suffix=".yaml") as copy:
            yaml.safe_dump(self.settings, copy)
            copy.flush()
            yield Path(copy.name)


def read_accelerate_config(name_or_path: str) -> AccelerateConfig:
    """The Accelerate config ``name_or_path`` (a file, or a name of :data:`SHIPPED`), checked: it parses, holds a
    mapping, its ODC keys are known and valid, and Accelerate accepts the rest. Raises ``ValueError`` in one line
    naming the file."""
    path, shipped = Path(name_or_path), False
    if not path.is_file():
        if name_or_path not in SHIPPED:
            raise ValueError(f"--accelerate_config {name_or_path}: no such file, nor a config hf_odc ships "
                             f"({', '.join(SHIPPED)})")  # fmt: skip
        path, shipped = shipped_config(name_or_path), True
    flag = f"--accelerate_config {name_or_path}"
    try:
        settings = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"{flag}: cannot be read: {' '.join(str(error).split())}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{flag}: an Accelerate config is a YAML mapping of keys to values")
    unknown = sorted(key for key in settings if key.startswith("odc") and key not in ODC_KEYS)
    if unknown:
        raise ValueError(
            f"{flag}: unknown ODC key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the ODC keys an "
            f"Accelerate config takes are {', '.join(ODC_KEYS)} (the flags of the same names)"
        )
    odc = {key: settings.pop(key) for key in list(settings) if key in ODC_KEYS}
    config = AccelerateConfig(path, settings, _odc_variables(odc, flag), shipped)
    with config.file_for_accelerate() as file:
        _check_with_accelerate(file, flag)
    return config


def _odc_variables(odc: dict[str, Any], flag: str) -> dict[str, str]:
    """The ``HF_ODC_*`` variables of an Accelerate config's ODC keys, each value checked as the variable would be."""
    checks = {
        "odc": lambda value, name: str(parse_bool(value, name)).lower(),
        "odc_timeout": lambda value, name: str(parse_seconds(value, name)),
        "odc_shard_size": lambda value, name: str(parse_shard_size(value)),
        "odc_transport": _transport,
    }
    variables = {}
    for key, value in odc.items():
        try:
            variables[PREFIX + ODC_KEYS[key]] = checks[key](value, key)
        except ValueError as error:
            raise ValueError(f"{flag}: {error}") from None
    return variables


def _transport(value: Any, name: str) -> str:
    if value not in TRANSPORTS:
        raise ValueError(f"{name} must be one of {', '.join(TRANSPORTS)}, got {value!r}.")
    return value


def _check_with_accelerate(file: Path, flag: str) -> None:
    """What Accelerate itself refuses in the file (an unknown key, a value of the wrong kind), as one line."""
    from accelerate.commands.config import load_config_from_file

    try:
        load_config_from_file(str(file))
    except (ValueError, TypeError, KeyError) as error:
        text = " ".join(str(error).split()).replace(str(file), flag.split(" ", 1)[1])
        raise ValueError(f"{flag}: Accelerate refuses it: {text}") from None


@dataclass
class LaunchOptions:
    """How many processes, on how many hosts: ``accelerate launch``'s options that ``hf-odc`` passes on."""

    num_processes: int
    num_machines: int | None = None
    machine_rank: int | None = None
    main_process_ip: str | None = None
    main_process_port: int | None = None

    def accelerate_flags(self) -> list[str]:
        flags = []
        for name, value in vars(self).items():
            if value is not None:
                flags += [f"--{name}", str(value)]
        return flags


def launch(program: str, script: Path, script_args: Sequence[str], config: AccelerateConfig, options: LaunchOptions,
           ) -> int:  # fmt: skip
    """Run ``script`` with ``script_args`` on ``options.num_processes`` processes under ``accelerate launch`` with
    ``config``, in this process; return the exit status: 0, the status of the worker that failed first (2 for the
    examples' one-line errors, which are not repeated), or ``128 + signal`` for a worker (or this launcher) ended by
    a signal. A failure other than a one-line error is said in one line, ``<program>: error: rank R (pid P) ...``,
    after the worker's own output, instead of torchrun's report."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with config.file_for_accelerate() as file, _quiet_torchrun(), _ending_stopped_workers():
        args = launch_command_parser().parse_args(
            ["--config_file", str(file), *options.accelerate_flags(), str(script), *script_args]
        )
        try:
            launch_command(args)
        except ChildFailedError as error:
            return _failed(program, error.failures)
        except SignalException as error:
            return 128 + int(error.sigval)
    return 0


def _failed(program: str, failures: dict[int, Any]) -> int:
    """The exit status of a launch whose workers ``failures`` (torchrun's, by global rank) failed, the first failure
    said in one line unless a worker already said it (status 2)."""
    if any(failure.exitcode == 2 for failure in failures.values()):
        return 2
    rank = min(failures, key=lambda r: failures[r].timestamp)
    failure = failures[rank]
    if failure.exitcode < 0:
        what, status = f"was ended by {signal.Signals(-failure.exitcode).name}", 128 - failure.exitcode
    else:
        what, status = f"exited with status {failure.exitcode}", failure.exitcode
    sys.stderr.write(f"{program}: error: rank {rank} (pid {failure.pid}) {what}; its output is above\n")
    return status


@contextlib.contextmanager
def _ending_stopped_workers(interval: float = 0.25) -> Iterator[None]:
    """Inside: once a worker has ended, the workers still stopped (SIGSTOP, a paused debugger) are ended with SIGKILL.
    The run is over by then (a peer named the stopped rank and exited, or the others finished), and torchrun would
    otherwise give a stopped process 30 s to act on its SIGTERM, which it cannot, before it kills it."""
    done = threading.Event()

    def watch() -> None:
        me, most = os.getpid(), 0
        while not done.wait(interval):
            workers = [pid for pid in procfs.pids() if procfs.parent(pid) == me]
            most = max(most, len(workers))
            if len(workers) < most:
                for pid in workers:
                    if procfs.stopped(procfs.process_state(pid)):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)

    watcher = threading.Thread(target=watch, name="hf_odc-stopped-workers", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


@contextlib.contextmanager
def _quiet_torchrun() -> Iterator[None]:
    """Inside: torchrun's own log lines (its note on ``OMP_NUM_THREADS``, each worker's failure and the signals it
    sends) are not printed; :func:`launch` says what failed itself."""
    loggers = [logging.getLogger(name) for name in _TORCHRUN_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)

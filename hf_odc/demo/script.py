"""What the example scripts share around their trainer: TRL's parser with the demos' command-line conventions
(:class:`ExampleParser`, which also checks the inputs the flags name, and :class:`GlobalBatchParser` for a global
minibatch that does not depend on the number of processes), the trainer built with its refusals in one line
(:func:`make_trainer`) and the end of a run (:func:`train_and_save`)."""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from datasets import Dataset
from trl import TrlParser

from ..trainer import _checkpoint
from .inputs import check_model, load_dataset_input, quiet_datasets_on_other_ranks
from .models import MODEL_CONFIGS


def train_and_save(trainer) -> None:
    """Train (resuming if asked), save the model and the trainer state, then release ODC and the process group."""
    output_dir = trainer.args.output_dir
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model(output_dir)
    trainer.save_state()
    trainer.accelerator.print(f"Training completed; model saved to {output_dir}.")
    trainer.end()  # release ODC, finish the trackers, destroy the process group


def make_trainer(trainer_class: type, **kwargs: Any) -> Any:
    """``trainer_class(**kwargs)``, its refusals (a ``ValueError``: data it cannot train on, a setting it does not
    support) ending the run in one line from the first process, as a bad flag does, rather than a traceback per
    process."""
    try:
        return trainer_class(**kwargs)
    except ValueError as error:
        fail(str(error))


def _any_dataset(dataset: Dataset, namespace: argparse.Namespace) -> None:
    """:class:`ExampleParser`'s default ``check_dataset``: the trainer checks the columns itself."""


_UNSET = object()

CHECKPOINT_FLAGS = frozenset({"save_steps", "save_total_limit", "save_only_model", "save_on_each_node"})
"""Flags that configure checkpoints: any of them switches saving on unless ``--save_strategy`` is given."""

ERROR_GRACE_S = 10.0
"""How long a process other than the first waits before exiting on a bad flag (the launcher ends it sooner, once the
first one has printed the error and exited)."""


def _leave_the_error_to_the_first_process() -> None:
    """In a process other than the first, wait and exit (status 2): under ``accelerate launch`` every process meets
    the same error, and one message is enough."""
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(ERROR_GRACE_S)  # the first process prints; the launcher ends this one when that one exits
        raise SystemExit(2)


def fail(message: str) -> NoReturn:
    """End the run with one error line, ``<script>: error: <message>``, from the first process only (as a bad flag
    does)."""
    _leave_the_error_to_the_first_process()
    sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: {message}\n")
    raise SystemExit(2)


class ExampleParser(TrlParser):
    """TRL's parser for the examples: the defaults they share, and what their command lines need.

    * Flags that imply others are completed before the configs are built (:meth:`complete`, from the flags given on
      the command line or in ``--config``): any checkpoint flag (:data:`CHECKPOINT_FLAGS`) switches saving on
      (``save_strategy="steps"``; the demos default to ``"no"``) unless ``--save_strategy`` is given.
    * A bad flag (unknown, unparsable, or refused by a config's checks) ends the run with argparse's short usage line
      and one error line, exit status 2, from the first process only: under ``accelerate launch`` every process
      parses the same flags, and each would print its traceback (the usage alone lists every TRL flag).
    * Gradient checkpointing is off by default: TRL turns it on, which only costs time on models this small.
      ``--gradient_checkpointing true`` turns it on (recent transformers renamed it ``--activation_checkpointing``;
      the ODC configs take either name without a warning).
    * LoRA's dropout defaults to 0 (TRL: 0.05): each process draws its own dropout masks, so with dropout one
      process and several would not train alike.
    * A flag is spelt in full: argparse's prefix matching is off, so ``--max_step 3`` is an unknown flag, not
      ``--max_steps 3``.
    * The inputs the flags name are checked before the configs are built (the training config joins the process
      group) and before any model is (:meth:`check_inputs`): a bad one ends the run with one line from the first
      process (:func:`fail`).

    Args:
        dataclass_types: The script's argument dataclasses.
        check_dataset: Raises ``ValueError`` for a ``--dataset_name`` dataset (its training split, loaded, with rows)
            that the script cannot train on; by default any is accepted. ``None``: the script trains on its built-in
            data only, and refuses the flag.
    """

    def __init__(
        self,
        dataclass_types: Iterable[type],
        check_dataset: Callable[[Dataset, argparse.Namespace], None] | None = _any_dataset,
    ):
        super().__init__(
            dataclass_types, usage="%(prog)s [--FLAG VALUE ...]  (--help lists the flags)", allow_abbrev=False
        )
        self._check_dataset = check_dataset
        self.set_defaults(
            logging_steps=1, save_strategy="no", report_to="none", gradient_checkpointing=None, lora_dropout=0.0
        )
        self._from_config: set[str] = set()

    def parse_args_and_config(self, args: Iterable[str] | None = None) -> tuple[Any, ...]:
        """The configs, or :meth:`error` for flags that are unknown (here or in ``--config``) or that a config's
        ``__post_init__`` refuses (a ``ValueError``)."""
        try:
            *configs, unknown = super().parse_args_and_config(args, return_remaining_strings=True)
        except ValueError as error:
            self.error(str(error))
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return tuple(configs)

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        self._from_config = set(kwargs)  # the --config file's settings count as given
        return super().set_defaults_with_config(**kwargs)

    def parse_known_args(
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, remaining = super().parse_known_args(args, namespace)
        # Parsed again over a namespace already holding every name: argparse then leaves alone what was not given.
        unset = argparse.Namespace(**{action.dest: _UNSET for action in self._actions})
        given = {name for name, value in vars(super().parse_known_args(args, unset)[0]).items() if value is not _UNSET}
        self.complete(parsed, given | self._from_config)
        if not remaining:  # else the flags are refused first (parse_args_and_config)
            try:
                self.check_inputs(parsed)
            except ValueError as error:
                fail(str(error))
        return parsed, remaining

    def check_inputs(self, namespace: argparse.Namespace) -> None:
        """Raise ``ValueError``, in one line, for an input that the flags name and the run could not use: the model
        (``--model_name_or_path``, else a ``--model_config`` path), the checkpoint to resume from (the trainer's own
        checks, :func:`hf_odc.trainer._checkpoint.check_resumable`) and the dataset (``--dataset_name``: it loads, its
        split has rows, and ``check_dataset`` accepts it)."""
        config = getattr(namespace, "model_config", None)
        if getattr(namespace, "model_name_or_path", None):
            check_model(namespace.model_name_or_path)
        elif config not in (None, *MODEL_CONFIGS) and not os.path.exists(config):
            raise ValueError(f"--model_config {config}: no such file or directory; name one of "
                             f"{', '.join(MODEL_CONFIGS)} or a config.json")  # fmt: skip
        resume = getattr(namespace, "resume_from_checkpoint", None)
        if isinstance(resume, str) and resume:
            if resume.lower() == "true" and not os.path.isdir(resume):
                with warnings.catch_warnings():  # the newer incomplete ones it passes over: the trainer says it once
                    warnings.simplefilter("ignore")
                    resume = _checkpoint.last_complete_checkpoint(namespace.output_dir)
            _checkpoint.check_resumable(resume)
        name = getattr(namespace, "dataset_name", None)
        if name:
            if self._check_dataset is None:
                raise ValueError(f"--dataset_name {name}: {self.prog} trains on its built-in data only")
            quiet_datasets_on_other_ranks()
            dataset = load_dataset_input(name, namespace.dataset_config, namespace.dataset_train_split)
            try:
                self._check_dataset(dataset, namespace)
            except ValueError as error:
                raise ValueError(f"--dataset_name {name}: {error}") from None

    def complete(self, namespace: argparse.Namespace, given: set[str]) -> None:
        """Complete ``namespace`` from the names of the flags ``given``."""
        if "save_strategy" not in given and given & CHECKPOINT_FLAGS:
            namespace.save_strategy = "steps"

    def error(self, message: str) -> NoReturn:
        _leave_the_error_to_the_first_process()
        super().error(message)


class GlobalBatchParser(ExampleParser):
    """:class:`ExampleParser` for a script whose arguments have a ``global_batch_size`` field: the global minibatch is
    the same whatever the number of processes (each gets ``global_batch_size / processes`` samples as
    ``per_device_train_batch_size``), unless ``--per_device_train_batch_size`` is given."""

    def complete(self, namespace: argparse.Namespace, given: set[str]) -> None:
        super().complete(namespace, given)
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        if "per_device_train_batch_size" in given:
            if "global_batch_size" in given:
                self.error("set --global_batch_size or --per_device_train_batch_size, not both")
            namespace.global_batch_size = namespace.per_device_train_batch_size * processes
            return
        if namespace.global_batch_size < processes or namespace.global_batch_size % processes:
            self.error(
                f"--global_batch_size {namespace.global_batch_size} is not a positive multiple of the number of "
                f"processes ({processes}); pick one that is, or set --per_device_train_batch_size"
            )
        namespace.per_device_train_batch_size = namespace.global_batch_size // processes

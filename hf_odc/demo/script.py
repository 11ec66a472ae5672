"""What the example scripts share around their trainer: TRL's parser with the demos' command-line conventions
(:class:`ExampleParser`, and :class:`GlobalBatchParser` for a global minibatch that does not depend on the number of
processes) and the end of a run (:func:`train_and_save`)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable
from typing import Any, NoReturn

from trl import TrlParser


def train_and_save(trainer) -> None:
    """Train (resuming if asked), save the model and the trainer state, then release ODC and the process group."""
    output_dir = trainer.args.output_dir
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model(output_dir)
    trainer.save_state()
    trainer.accelerator.print(f"Training completed; model saved to {output_dir}.")
    trainer.end()  # release ODC, finish the trackers, destroy the process group


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
    """

    def __init__(self, dataclass_types: Iterable[type]):
        super().__init__(dataclass_types, usage="%(prog)s [--FLAG VALUE ...]  (--help lists the flags)")
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
        return parsed, remaining

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

"""What the example scripts share around their trainer: the script arguments of the built-in model and data
(:class:`_DemoScriptArguments` and its subclasses), TRL's parser with the demos' command-line conventions
(:class:`ExampleParser`, which also checks the inputs the flags name, and :class:`GlobalBatchParser` for a global
minibatch that does not depend on the number of processes), the training data (:func:`load_script_dataset`,
:func:`built_in_prompts`), the reference model of the initial policy (:func:`initial_reference`,
:func:`save_policy_for_reference`; :func:`policy_model_config` for a vLLM engine), the trainer built with its refusals
in one line (:func:`make_trainer`) and the end of a run (:func:`train_and_save`)."""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import yaml
from datasets import Dataset
from trl import ModelConfig, ScriptArguments, TrlParser
from trl.import_utils import is_vllm_available

from .._env import env
from ..liveness import PeerFailureError
from ..packing import DISTRIBUTIONS, CapacityError
from ..trainer.core import _checkpoint_format
from .data import prompt_dataset
from .inputs import check_model, check_model_config, load_dataset_input, quiet_datasets_on_other_ranks
from .models import MODEL_CONFIGS, build_model, save_initial_model


@dataclass
class _DemoScriptArguments(ScriptArguments):
    """TRL's script arguments, plus the built-in model and the shape of the built-in data that every example takes.

    Args:
        model_config (`str`, *optional*, defaults to `"tiny"`):
            Model built from a config, with random weights, when `model_name_or_path` is not set: `"tiny"` (Llama),
            `"tiny-vllm"` (the same size in a shape vLLM's CPU engine takes; what `"tiny"` becomes in the examples that
            generate, with `--use_vllm`), `"tiny-moe"` (Qwen3-MoE; the trainers whose router loss is not checked
            against TRL's refuse it with that loss on), `"qwen2-0.5b"`, `"qwen2.5-1.5b"`, or a path to a `config.json`
            (a file or a directory holding one).
        length_distribution (`str`, *optional*, defaults to `"swe-smith"`):
            Shape of the built-in data's lengths: one of `hf_odc.packing.DISTRIBUTIONS`, rescaled so that its longest
            is `max_length` tokens (a script that generates: the asked reply lengths, and its synthetic completions',
            rescaled to `max_completion_length`).
    """

    model_config: str = field(
        default="tiny",
        metadata={
            "help": "Model config when model_name_or_path is unset: 'tiny', 'tiny-vllm', 'tiny-moe', 'qwen2-0.5b', "
            "'qwen2.5-1.5b' or a path."
        },
    )
    length_distribution: str = field(
        default="swe-smith",
        metadata={"help": "Length shape of the built-in data.", "choices": sorted(DISTRIBUTIONS)},
    )


@dataclass
class GlobalBatchScriptArguments(_DemoScriptArguments):
    """:class:`_DemoScriptArguments`, plus the global minibatch of :class:`GlobalBatchParser`.

    Args:
        global_batch_size (`int`, *optional*, defaults to `16`):
            Samples (pairs, examples) per optimizer step over all processes: each process gets `global_batch_size /
            processes` (`per_device_train_batch_size`), so that one process and several train on the same
            minibatches. Set this or `--per_device_train_batch_size`, not both.
    """

    global_batch_size: int = field(
        default=16,
        metadata={
            "help": "Samples per optimizer step over all processes (per_device_train_batch_size = this / processes). "
            "Exclusive with per_device_train_batch_size."
        },
    )


@dataclass
class PromptScriptArguments(_DemoScriptArguments):
    """:class:`_DemoScriptArguments`, plus the size of the built-in prompt set of the scripts that generate.

    Args:
        num_prompts (`int`, *optional*, defaults to `256`):
            Number of prompts of the built-in prompt set.
    """

    num_prompts: int = field(default=256, metadata={"help": "Number of prompts of the built-in prompt set."})


def load_script_dataset(script_args: ScriptArguments) -> Dataset:
    """``--dataset_name``'s ``--dataset_train_split``: a directory saved with ``save_to_disk``, a data file, or a
    dataset ``load_dataset`` finds (:func:`~hf_odc.demo.inputs.load_dataset_input`, checked as the command line was
    parsed)."""
    return load_dataset_input(script_args.dataset_name, script_args.dataset_config, script_args.dataset_train_split)


def built_in_prompts(script_args: PromptScriptArguments, training_args: Any) -> Dataset:
    """The built-in prompts (:func:`~hf_odc.demo.prompt_dataset`), asking for reply lengths up to
    ``max_completion_length``."""
    return prompt_dataset(
        script_args.num_prompts,
        training_args.max_completion_length,
        script_args.length_distribution,
        training_args.seed,
    )


def initial_reference(
    model: Any,
    script_args: _DemoScriptArguments,
    training_args: Any,
    model_args: ModelConfig,
    tokenizer: Any,
    peft_config: Any,
) -> Any:
    """DPO's and KTO's reference model for the policy ``model``: the initial policy, built again from the same seed
    (or loaded again from the same path). ``None`` with a LoRA adapter (the trainer uses the policy with its adapter
    disabled; a policy built from a config is saved under the output directory first, for the adapter to name its
    base) or with precomputed reference log-probabilities (the trainer computes them before training, and keeps no
    copy)."""
    if peft_config is not None:
        if not model_args.model_name_or_path:
            save_initial_model(model, os.path.join(training_args.output_dir, "base_model"), training_args)
        return None
    if training_args.precompute_ref_log_probs:
        return None
    return build_model(script_args.model_config, model_args, tokenizer, seed=training_args.seed)


def policy_model_config(script_args: _DemoScriptArguments, training_args: Any) -> str:
    """The built-in policy shape of a script that generates: ``--model_config``, except that ``"tiny"`` becomes
    ``"tiny-vllm"`` with ``--use_vllm`` (a shape vLLM's CPU engine loads and keeps in sync; see
    :data:`~hf_odc.demo.models.MODEL_CONFIGS`)."""
    if training_args.use_vllm and script_args.model_config == "tiny":
        return "tiny-vllm"
    return script_args.model_config


def save_policy_for_reference(
    model: Any, training_args: Any, model_args: ModelConfig, peft_config: Any, tokenizer: Any = None
) -> None:
    """For GRPO and RLOO, which load their KL reference model from the policy's name (``beta != 0``), for a LoRA
    adapter, which records its base model's name, and for a vLLM engine (``use_vllm``), which loads the policy and
    ``tokenizer`` from the policy's name: a policy built from a config is saved under the output directory
    (``initial-policy``), with ``tokenizer``, and named by that path."""
    needed = training_args.beta != 0.0 or peft_config is not None or training_args.use_vllm
    if needed and not model_args.model_name_or_path:
        path = os.path.join(training_args.output_dir, "initial-policy")
        save_initial_model(model, path, training_args, tokenizer)


def train_and_save(trainer) -> None:
    """Train (resuming if asked), save the model and the trainer state, then release ODC and the process group.

    A peer that died, raised or went silent ends this process with hf_odc's one line naming it
    (``PeerFailureError: hf_odc: rank R ...``), exit status 1: the traceback would only show where this rank waited,
    and the backend's error it chains (gloo's "Connection reset by peer") would come before the line. A generated
    rollout longer than a microbatch (a :class:`~hf_odc.packing.CapacityError`, met by every rank in the same step)
    ends it as a bad flag does: one line from the first process, exit status 2."""
    output_dir = trainer.args.output_dir
    try:
        trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    except PeerFailureError as error:
        sys.stderr.write(f"{type(error).__name__}: {error}\n")
        raise SystemExit(1) from None
    except CapacityError as error:  # a generated rollout longer than a microbatch: every rank meets it at once
        fail(str(error))
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


def _one_line(error: Exception, recipe: str | None) -> str:
    """``error``, raised while the command line and the ``recipe`` (``--config``) were read, as one line."""
    if isinstance(error, OSError) and recipe is not None and error.filename == recipe:
        return f"--config {recipe}: {error.strerror.lower() if error.strerror else error}"
    if isinstance(error, yaml.YAMLError):
        return f"--config {recipe}: not valid YAML: {' '.join(str(error).split())}"
    return " ".join(str(error).split())


def _any_dataset(dataset: Dataset, namespace: argparse.Namespace) -> None:
    """:class:`ExampleParser`'s default ``check_dataset``: the trainer checks the columns itself."""


_UNSET = object()

_CHECKPOINT_FLAGS = frozenset({"save_steps", "save_total_limit", "save_only_model", "save_on_each_node"})
"""Flags that configure checkpoints: any of them switches saving on unless ``--save_strategy`` is given."""

LAUNCH_KEYS = frozenset(
    {"num_processes", "accelerate_config", "num_machines", "machine_rank", "main_process_ip", "main_process_port"}
)
"""Keys of a ``--config`` recipe that say how to launch the script, not how to train: ``hf-odc`` reads them (as TRL's
``trl`` command does), the script passes over them."""

ERROR_GRACE_S = 10.0
"""How long a process other than the first waits before exiting on a bad flag (the launcher ends it sooner, once the
first one has printed the error and exited)."""


def _leave_the_error_to_the_first_process() -> None:
    """In a process other than the first, wait and exit (status 2): under ``accelerate launch`` every process meets
    the same error, and one message is enough."""
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(ERROR_GRACE_S)  # the first process prints; the launcher ends this one when that one exits
        raise SystemExit(2)


def program_name() -> str:
    """What the scripts' error lines call the program: ``HF_ODC_PROG`` (``hf-odc sft`` when the command line launched
    the script), else the script's file name."""
    return env("PROG") or os.path.basename(sys.argv[0])


def fail(message: str) -> NoReturn:
    """End the run with one error line, ``<program>: error: <message>`` (:func:`program_name`), from the first process
    only, exit status 2, as a bad flag does."""
    _leave_the_error_to_the_first_process()
    sys.stderr.write(f"{program_name()}: error: {message}\n")
    raise SystemExit(2)


class ExampleParser(TrlParser):
    """TRL's parser for the examples: the defaults they share, and what their command lines need.

    * Flags that imply others are completed before the configs are built (:meth:`complete`, from the flags given on
      the command line or in ``--config``): any checkpoint flag (:data:`_CHECKPOINT_FLAGS`) switches saving on
      (``save_strategy="steps"``; the demos default to ``"no"``) unless ``--save_strategy`` is given.
    * A bad flag (unknown, unparsable, or refused by a config's checks), a ``--config`` recipe that cannot be read or
      that holds a key no flag takes, ends the run with one error line (:func:`fail`), exit status 2, from the first
      process only: under ``accelerate launch`` every process parses the same flags, and each would print its
      traceback (argparse's usage line would list every TRL flag). A recipe's :data:`LAUNCH_KEYS` are passed over.
    * Gradient checkpointing is off by default: TRL turns it on, which only costs time on models this small.
      ``--gradient_checkpointing true`` turns it on (recent transformers renamed it ``--activation_checkpointing``;
      the ODC configs take either name without a warning).
    * LoRA's dropout defaults to 0 (TRL: 0.05): each process draws its own dropout masks, so with dropout one
      process and several would not train alike.
    * A flag is spelt in full: argparse's prefix matching is off, so ``--max_step 3`` is an unknown flag, not
      ``--max_steps 3``.
    * ``--parallelism_config`` takes Accelerate's ``ParallelismConfig`` as JSON (``'{"sp_size": 2}'``: documents
      longer than a microbatch split over 2 ranks), which the ODC configs read; transformers' parser would call the
      class with the text.
    * The inputs the flags name are checked before the configs are built (the training config joins the process
      group) and before any model is (:meth:`check_inputs`): a bad one ends the run with one line from the first
      process (:func:`fail`).

    Args:
        dataclass_types: The script's argument dataclasses.
        check_dataset: Raises ``ValueError`` for a ``--dataset_name`` dataset (its training split, loaded, with rows)
            that the script cannot train on; by default any is accepted. ``None``: the script trains on its built-in
            data only, and refuses the flag.
        built_in_models: The names ``--model_config`` takes for the script's built-in models (the text scripts':
            :data:`~hf_odc.demo.models.MODEL_CONFIGS`).
        model_config_files: Whether ``--model_config`` also takes a ``config.json`` path (the text scripts build any
            causal LM's config; the vision script only its built-in shapes).
    """

    def __init__(
        self,
        dataclass_types: Iterable[type],
        check_dataset: Callable[[Dataset, argparse.Namespace], None] | None = _any_dataset,
        built_in_models: Collection[str] = tuple(MODEL_CONFIGS),
        model_config_files: bool = True,
    ):
        super().__init__(
            dataclass_types,
            prog=env("PROG"),
            usage="%(prog)s [--FLAG VALUE ...]  (--help lists the flags)",
            allow_abbrev=False,
        )
        self._check_dataset = check_dataset
        self._built_in_models, self._model_config_files = tuple(built_in_models), model_config_files
        for action in self._actions:
            if action.dest == "parallelism_config":
                action.type = str  # JSON, read by the ODC configs (hf_odc.accelerate_plugin.parallelism_config_from)
        self.set_defaults(
            logging_steps=1, save_strategy="no", report_to="none", gradient_checkpointing=None, lora_dropout=0.0
        )
        self._from_config: set[str] = set()

    def parse_args_and_config(self, args: Iterable[str] | None = None) -> tuple[Any, ...]:
        """The configs, or :meth:`error` for flags that are unknown (here or in ``--config``), a recipe that cannot be
        read, or flags that a config's ``__post_init__`` refuses (a ``ValueError``)."""
        args = list(args) if args is not None else sys.argv[1:]
        recipe = args[args.index("--config") + 1] if "--config" in args[:-1] else None
        try:
            *configs, from_recipe, unknown = super().parse_args_and_config(
                args, return_remaining_strings=True, separate_remaining_strings=True
            )
        except (ValueError, OSError, yaml.YAMLError) as error:
            self.error(_one_line(error, recipe))
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        keys = [key[2:] for key in from_recipe[::2] if key[2:] not in LAUNCH_KEYS]
        if keys:
            plural = len(keys) > 1
            self.error(f"--config {recipe}: no flag takes the key{'s' if plural else ''} {', '.join(keys)}; remove "
                       f"{'them' if plural else 'it'} or fix the spelling (--help lists the flags)")  # fmt: skip
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
        (``--model_name_or_path``, else a ``--model_config`` path: its config is one transformers builds), vLLM
        (``--use_vllm``: installed), the checkpoint to resume from (the trainer's own checks,
        :func:`hf_odc.trainer.core._checkpoint_format.check_resumable`) and the dataset (``--dataset_name``: it loads,
        its split has rows, and ``check_dataset`` accepts it)."""
        config = getattr(namespace, "model_config", None)
        if getattr(namespace, "model_name_or_path", None):
            check_model(namespace.model_name_or_path)
        elif config not in (None, *self._built_in_models):
            if not self._model_config_files:
                raise ValueError(
                    f"--model_config {config}: name one of {', '.join(self._built_in_models)}, the built-in shapes, "
                    "or pass --model_name_or_path"
                )
            check_model_config(config, self._built_in_models)
        if getattr(namespace, "use_vllm", False) and not is_vllm_available():
            raise ValueError("--use_vllm: vLLM is not installed in this environment; install it (docs/api.md, "
                             "\"vLLM on CPU, end to end\", for a CPU) or leave --use_vllm out to decode with "
                             "transformers (--odc_generation)")  # fmt: skip
        resume = getattr(namespace, "resume_from_checkpoint", None)
        if isinstance(resume, str) and resume:
            if resume.lower() == "true" and not os.path.isdir(resume):
                with warnings.catch_warnings():  # the newer incomplete ones it passes over: the trainer says it once
                    warnings.simplefilter("ignore")
                    resume = _checkpoint_format.last_complete_checkpoint(namespace.output_dir)
            _checkpoint_format.check_resumable(resume)
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
        if "save_strategy" not in given and given & _CHECKPOINT_FLAGS:
            namespace.save_strategy = "steps"

    def error(self, message: str) -> NoReturn:
        fail(message)


class GlobalBatchParser(ExampleParser):
    """:class:`ExampleParser` for a script whose arguments have a ``global_batch_size`` field: the global minibatch is
    the same whatever the number of processes (each gets ``global_batch_size / processes`` samples as
    ``per_device_train_batch_size``), unless ``--per_device_train_batch_size`` is given.

    The number of processes is the launcher's (``WORLD_SIZE``), or :attr:`processes` once set: ``hf-odc`` parses the
    command line before it launches them."""

    processes: int | None = None

    def complete(self, namespace: argparse.Namespace, given: set[str]) -> None:
        super().complete(namespace, given)
        processes = self.processes or int(os.environ.get("WORLD_SIZE", "1"))
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

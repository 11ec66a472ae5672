"""``hf-odc sft|dpo|grpo|rloo|kto|reward|distill``: the example scripts (``examples/<name>.py``) run as TRL's ``trl``
command runs its own, with the same arguments (TRL's flags and ``--config recipe.yaml``, plus the ODC fields and the
examples' own), on ``--num_processes`` processes under Accelerate's launcher and an ODC Accelerate config.

Every input is checked here, in the launching process, before a worker starts: the launch options and the Accelerate
config (:mod:`hf_odc.cli.launch`), then the script's whole command line, parsed by the script's own parser
(``make_parser()``, an :class:`hf_odc.demo.ExampleParser`) as each worker will parse it: unknown or unparsable flags
and recipe keys, the flags' combinations (the training config's own checks, with the ``FSDP_*`` and ``HF_ODC_*``
variables the workers will see), the global minibatch against the number of processes, the model (its folder's
config and tokenizer), the dataset (its path, rows and columns), a checkpoint to resume from, and vLLM for
``--use_vllm``. A bad one ends the command with one line on standard error, ``hf-odc <name>: error: ...``, and exit
status 2. What only the tokenized data shows (samples longer than a microbatch, truncation that leaves most of them with
nothing to learn) is checked here too where the script has a ``check_training_data(script_args, training_args,
model_args, num_processes)`` (SFT, DPO, KTO and reward modelling: the trainer's own checks, on the data tokenized as
TRL's trainer tokenizes it, without a model, for the processes to come); the other trainers refuse it as they are
built, in the workers, in the same one line and status.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import yaml

from . import _TRAINING, _TRAINING_ALIASES
from .launch import LaunchOptions, default_config_name, launch, read_accelerate_config

COMMANDS = _TRAINING
"""The training commands, each running ``examples/<name>.py``, with what it trains."""

ALIASES = _TRAINING_ALIASES
"""TRL's names for the commands hf_odc names otherwise."""

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
"""Where the scripts the commands run live: the ``examples`` folder of the checkout hf_odc is installed from."""

_USAGE = """usage: {program} [--config RECIPE.yaml] [--FLAG VALUE ...] [--num_processes N] [--accelerate_config F]

Runs examples/{script} ({what}) on N processes under Accelerate's launcher, every input checked first.

launch options (the others are the script's, listed below; a recipe may hold these keys too):
  --num_processes N       processes in all (default: the GPUs of this host, or the Accelerate config's, 2 on CPU)
  --accelerate_config F   an Accelerate config file, or one hf_odc ships: {shipped} (default: odc with GPUs,
                          odc_cpu without); it may hold the keys {odc_keys}
  --num_machines, --machine_rank, --main_process_ip, --main_process_port
                          several hosts (docs/multi_host.md), as accelerate launch takes them
"""


def run_training(command: str, argv: Sequence[str]) -> int:
    """Run the training command ``command`` (a name of :data:`COMMANDS` or :data:`ALIASES`) with the arguments
    ``argv``; return its exit status."""
    command = ALIASES.get(command, command)
    program = f"hf-odc {command}"
    os.environ["HF_ODC_PROG"] = program  # the name the script's one-line errors give, here and in every worker
    try:
        return _run(command, program, list(argv))
    except ValueError as error:
        _fail(program, str(error))


def _fail(program: str, message: str) -> NoReturn:
    sys.stderr.write(f"{program}: error: {message}\n")
    raise SystemExit(2)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


LAUNCH_OPTIONS = {
    "num_processes": _positive_int,
    "accelerate_config": str,
    "num_machines": _positive_int,
    "machine_rank": int,
    "main_process_ip": str,
    "main_process_port": int,
}
"""The launch options (on the command line or in a recipe: :data:`hf_odc.demo.script.LAUNCH_KEYS`) and their types;
the rest of the command line is the script's."""


class _LaunchParser(argparse.ArgumentParser):
    """The launch options, taken out of the command line; the rest is the script's."""

    def __init__(self, program: str):
        super().__init__(prog=program, add_help=False, allow_abbrev=False)
        for name, kind in LAUNCH_OPTIONS.items():  # with the dashed spelling that TRL's and Accelerate's flags take
            self.add_argument(f"--{name}", f"--{name.replace('_', '-')}", type=kind)

    def error(self, message: str) -> NoReturn:
        _fail(self.prog, message)


def _run(command: str, program: str, argv: list[str]) -> int:
    script = EXAMPLES / f"{command}.py"
    if not script.is_file():
        raise ValueError(
            f"{program} runs examples/{command}.py of the checkout hf_odc is installed from, and there is none at "
            f"{script}: install hf_odc from its repository (pip install -e .)"
        )
    options, script_args = _LaunchParser(program).parse_known_args(argv)
    if {"-h", "--help"} & set(script_args):
        _print_help(program, command, script)
    _take_recipe_launch_keys(options, script_args, program)

    import torch

    cuda = torch.cuda.is_available()
    config = read_accelerate_config(options.accelerate_config or default_config_name(cuda))
    gpus = torch.cuda.device_count() if cuda and not config.use_cpu else 0
    processes = options.num_processes or (gpus if config.shipped and gpus else config.num_processes) or 1
    if gpus and (options.num_machines or 1) == 1 and processes > gpus:
        raise ValueError(f"--num_processes {processes}: this host has {gpus} GPU{'s' if gpus > 1 else ''}, one per "
                         "process; ask for at most that many")  # fmt: skip
    os.environ.update(config.odc_variables)

    module = _load_script(script)
    parser = module.make_parser()
    parser.processes = processes  # the global minibatch is split over the processes to come (GlobalBatchParser)
    with _environment(config.fsdp_variables()), _quiet():
        configs = parser.parse_args_and_config(script_args)  # every check; one line and exit status 2 on a bad input
        check_training_data = getattr(module, "check_training_data", None)
        if check_training_data is not None:  # the trainer's checks of its tokenized data (a ValueError: one line)
            check_training_data(*configs, num_processes=processes)
    launch_options = LaunchOptions(
        processes, options.num_machines, options.machine_rank, options.main_process_ip, options.main_process_port
    )
    return launch(program, script, script_args, config, launch_options)


def _take_recipe_launch_keys(options: argparse.Namespace, script_args: list[str], program: str) -> None:
    """The launch options a ``--config`` recipe holds (TRL's recipes may), where the command line gave none. A recipe
    that cannot be read is left to the script's parser, which says so."""
    if "--config" not in script_args[:-1]:
        return
    try:
        recipe = yaml.safe_load(Path(script_args[script_args.index("--config") + 1]).read_text())
    except (OSError, yaml.YAMLError):
        return
    if not isinstance(recipe, dict):
        return
    flags = [f"--{key}={value}" for key, value in recipe.items() if key in vars(options)]
    given = vars(_LaunchParser(program).parse_args(flags))
    for name, value in given.items():
        if getattr(options, name) is None:
            setattr(options, name, value)


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """Inside: ``variables`` set in this process (the workers get them from Accelerate), as they were after."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Inside: no warning and no progress bar, only errors: what the checks print, the first worker prints again
    (datasets reading a data file, the libraries' notes on the training config)."""
    import datasets
    import transformers

    verbosity, bars = transformers.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def _load_script(script: Path) -> ModuleType:
    """The example ``script`` as a module, its ``__main__`` block not run: its ``make_parser()`` is the command's."""
    spec = importlib.util.spec_from_file_location(f"hf_odc_example_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclasses' annotations are resolved
    spec.loader.exec_module(module)
    return module


def _print_help(program: str, command: str, script: Path) -> NoReturn:
    from .launch import ODC_KEYS, SHIPPED

    what, shipped, odc_keys = COMMANDS[command], ", ".join(SHIPPED), ", ".join(ODC_KEYS)
    sys.stdout.write(_USAGE.format(program=program, script=script.name, what=what, shipped=shipped, odc_keys=odc_keys))
    sys.stdout.write("\n")
    parser: Any = _load_script(script).make_parser()
    parser.usage = argparse.SUPPRESS
    parser.print_help()
    raise SystemExit(0)

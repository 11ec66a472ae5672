"""The ``hf-odc`` command line: ``hf-odc sft|dpo|grpo|rloo|kto|reward|distill`` (:mod:`hf_odc.cli.train`: an example
script launched on ODC, every input checked first), ``hf-odc env`` (:mod:`hf_odc.cli.env`: what a bug report needs)
and ``hf-odc plan`` (its arguments here, its back end :mod:`hf_odc.cli.plan`). A training command's arguments are the
script's, passed on whole; the others are parsed here."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..packing.distributions import DISTRIBUTIONS

if TYPE_CHECKING:
    from ..packing.cost import CostLike
    from .plan import CrossHost

_PLAN_EXAMPLES = """examples:
  hf-odc plan                                         # LongAlign-like lengths, world sizes 2-128
  hf-odc plan --distribution swe-smith --packing-ratio 2 --plot plan.png
  hf-odc plan --dataset ./my_sft --column input_ids --world-sizes 8,64 --max-tokens 32768 --json plan.json
  hf-odc plan --dataset ./my_chats --column messages --tokenizer ./Qwen2-7B --json - | jq .results  # table: stderr
  hf-odc plan --world-sizes 16,64,256 --gpus-per-host 8 --cross-host-gbps 25 --model-config ./Qwen2-7B  # hybrid
  hf-odc plan --world-sizes 16,64 --gpus-per-host 8 --calibration odc_calibration.json --params 1.5e9
  hf-odc plan --distribution longalign --max-tokens 32768 --sp-size 4 --world-sizes 8,32  # documents up to 128K
"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in (*_TRAINING, *_TRAINING_ALIASES):
        from .train import run_training  # imports torch, transformers and TRL: not for the other commands

        return run_training(argv[0], argv[1:])
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        args.handler(args)
    except (ValueError, ImportError, OSError) as error:
        parser.exit(2, f"hf-odc {args.command}: error: {error}\n")
    return 0


# The training commands (hf_odc.cli.train.COMMANDS and ALIASES), named here so that `hf-odc plan` imports no torch.
_TRAINING = {
    "sft": "supervised fine-tuning",
    "dpo": "Direct Preference Optimization",
    "grpo": "GRPO (online RL, generating with the policy)",
    "rloo": "REINFORCE Leave-One-Out (online RL)",
    "kto": "Kahneman-Tversky Optimization",
    "reward": "reward modelling",
    "distill": "on-policy distillation",
}
_TRAINING_ALIASES = {"distillation": "distill"}


def _build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: a flag is spelt in full (argparse would take "--world 8" for --world-sizes, silently).
    parser = argparse.ArgumentParser(
        prog="hf-odc", description="On-Demand Communication for FSDP2: training and tools.", allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, what in _TRAINING.items():
        aliases = [alias for alias, command in _TRAINING_ALIASES.items() if command == name]
        commands.add_parser(name, aliases=aliases, help=f"train with ODC: {what} (examples/{name}.py; --help)")
    env = commands.add_parser("env", help="print what a bug report needs: versions, devices, the transport")
    env.set_defaults(handler=_run_env)
    _add_plan(commands)
    return parser


def _run_env(args: argparse.Namespace) -> None:
    from .env import print_env

    print_env()


def _add_plan(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan",
        help="predict bubble rates and speedups of ODC + LB-Mini against collective FSDP",
        description=(
            "Draw minibatches of sequence lengths, plan them with Collective+LocalSort, Collective+LB-Micro, "
            "ODC+LB-Micro and ODC+LB-Mini, and print each scheme's predicted idle fraction (bubble) and speedup "
            "over Collective+LB-Micro for each world size."
        ),
        epilog=_PLAN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    source = plan.add_argument_group("lengths (default: --distribution longalign)")
    exclusive = source.add_mutually_exclusive_group()
    exclusive.add_argument(
        "--distribution",
        default="longalign",
        choices=sorted(DISTRIBUTIONS),
        help="a built-in synthetic distribution: "
        + "; ".join(f"{name}: {dist.description}" for name, dist in DISTRIBUTIONS.items()),
    )
    exclusive.add_argument("--lengths", metavar="FILE", help="a JSON list, CSV column or text file of integers")
    exclusive.add_argument("--dataset", metavar="DIR", help="a datasets dataset saved with save_to_disk")
    source.add_argument(
        "--column",
        help="the dataset's (or CSV's) column: integer lengths or token ids (lists of integers); with --tokenizer, "
        "text or chat messages (lists of {role, content} dicts)",
    )
    source.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a local tokenizer or model directory (needs transformers) to count the tokens of a --dataset text "
        "column (tokenizer(text), special tokens included) or chat column (apply_chat_template(messages))",
    )
    source.add_argument("--split", default="train", help="the split, if the dataset is a DatasetDict (default: train)")

    shape = plan.add_argument_group("minibatch")
    shape.add_argument(
        "--world-sizes",
        type=_positive_ints,
        default=[2, 8, 32, 128],
        metavar="N,N,...",
        help="numbers of ranks to simulate (default: 2,8,32,128)",
    )
    shape.add_argument(
        "--samples-per-rank",
        type=_positive_int,
        default=8,
        metavar="N",
        help="samples per rank per minibatch (default: 8)",
    )
    cap = shape.add_mutually_exclusive_group()
    cap.add_argument("--max-tokens", type=_positive_int, metavar="N", help="token cap of one microbatch")
    cap.add_argument(
        "--packing-ratio",
        type=float,
        default=1.0,
        metavar="R",
        help="token cap as a multiple of the longest possible sample (default: 1.0)",
    )
    shape.add_argument(
        "--sp-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="sequence parallelism: samples of up to N times the cap are split over groups of N ranks (ODC+LB-Mini: "
        "those longer than the cap only, as group microbatches; the other schemes: every microbatch); N must divide "
        "every world size (default: 1)",
    )

    cost = plan.add_argument_group("cost model (default: --cost attention)")
    exclusive = cost.add_mutually_exclusive_group()
    exclusive.add_argument(
        "--cost",
        choices=["tokens", "attention"],
        default="attention",
        help="tokens: linear; attention: FLOPs of a Qwen2-0.5B-like model (default)",
    )
    exclusive.add_argument("--model-config", metavar="PATH", help="FLOPs of this model (config.json or its directory)")
    exclusive.add_argument(
        "--calibration",
        metavar="FILE",
        help="a trainer's odc_calibration.json (cost_model='calibrated'), or a JSON list of measured microbatches "
        "[sequences, tokens, sum_sq_lengths, seconds] to fit",
    )

    hybrid = plan.add_argument_group(
        "hybrid ODC across hosts",
        "Shard within hosts of G GPUs, replicate across them (HSDP's layout): adds HSDP+LB-Micro and "
        "Hybrid ODC+LB-Mini rows, each paying one all-reduce of the fp32 gradient shards across hosts per minibatch, "
        "for world sizes that are multiples of G above G.",
    )
    hybrid.add_argument("--gpus-per-host", type=_positive_int, metavar="G", help="GPUs per host: turns the rows on")
    hybrid.add_argument(
        "--cross-host-gbps",
        type=_positive_float,
        metavar="B",
        help="cross-host bandwidth per GPU in GB/s (default: 50, one 400 Gb/s NIC per GPU)",
    )
    hybrid.add_argument(
        "--params",
        type=_positive_float,
        metavar="P",
        help="parameter count, e.g. 1.5e9 (default: from the attention cost; required with --calibration)",
    )
    hybrid.add_argument(
        "--tflops",
        type=_positive_float,
        metavar="T",
        help="achieved training TFLOP/s per GPU, the time scale of an attention cost: a step is 3x its forward "
        "FLOPs (default: 200; not with --calibration, which is in seconds)",
    )

    run = plan.add_argument_group("simulation and output")
    run.add_argument(
        "--minibatches",
        type=_positive_int,
        default=10,
        metavar="N",
        help="minibatches per world size to average over (default: 10)",
    )
    run.add_argument("--seed", type=int, default=0, help="seed of the minibatch draws (default: 0)")
    run.add_argument(
        "--json",
        metavar="FILE",
        help="also write the numbers as JSON; - writes them to standard output and the table to standard error, "
        "so that the output can be piped",
    )
    run.add_argument("--plot", metavar="FILE", help="also draw timelines and speedups (needs hf-odc[plot])")
    plan.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> None:
    from rich.console import Console

    from ..packing.planners import max_tokens_for
    from .plan import choose_cost, choose_source, simulate
    from .plan.report import render_table, write_json

    source = choose_source(args.distribution, args.lengths, args.dataset, args.column, args.split, args.tokenizer)
    max_tokens = args.max_tokens or max_tokens_for(source.max_length, args.packing_ratio)
    _check_cap(source, max_tokens, args.sp_size)
    cost = choose_cost(args.cost, args.model_config, args.calibration, max_tokens)
    cross_host = _cross_host(args, cost)
    simulation = simulate(
        source,
        args.world_sizes,
        args.samples_per_rank,
        max_tokens,
        cost,
        args.minibatches,
        args.seed,
        cross_host,
        args.sp_size,
    )
    render_table(simulation, Console(stderr=args.json == "-"))
    if args.json:
        write_json(simulation, sys.stdout if args.json == "-" else args.json)
    if args.plot:
        from .plan.plot import plot_simulation

        plot_simulation(simulation, args.plot)


def _cross_host(args: argparse.Namespace, cost: CostLike) -> CrossHost | None:
    """The hybrid layout, or ``None`` without ``--gpus-per-host``. Its other options alone would print nothing
    different, and no world size spanning hosts would print no hybrid row: both are refused, not ignored."""
    from .plan import CrossHost

    options = {"--cross-host-gbps": args.cross_host_gbps, "--params": args.params, "--tflops": args.tflops}
    if args.gpus_per_host is None:
        given = [flag for flag, value in options.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --gpus-per-host: they describe the hybrid layout across hosts.")
        return None
    cross_host = CrossHost.for_cost(cost, args.gpus_per_host, args.cross_host_gbps, args.params, args.tflops)
    if not any(map(cross_host.spans_hosts, args.world_sizes)):
        raise ValueError(
            f"--gpus-per-host {args.gpus_per_host}: none of --world-sizes {','.join(map(str, args.world_sizes))} "
            f"spans several hosts; give multiples of {args.gpus_per_host} above it."
        )
    return cross_host


def _check_cap(source, max_tokens: int, sp_size: int = 1) -> None:
    """Refuse a cap below the longest sample (``sp_size`` caps with sequence parallelism) before simulating: the
    planners' own error would name a sample's place in a random minibatch, not in the user's lengths, and a built-in
    distribution may only fail later."""
    if source.max_length <= sp_size * max_tokens:
        return
    lengths = getattr(source, "lengths", None)
    if lengths:
        what = f"Sample {lengths.index(source.max_length)} of {source.name} has {source.max_length} tokens"
    else:
        what = f"{source.name} draws samples of up to {source.max_length} tokens"
    raise ValueError(
        f"{what}, more than {f'--sp-size {sp_size} x ' if sp_size > 1 else ''}max_tokens={max_tokens}; raise "
        "--max-tokens or --packing-ratio (to 1.0 at least) or --sp-size: the planners never truncate."
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # else argparse reports "invalid _positive_ints value"
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _positive_ints(text: str) -> list[int]:
    return [_positive_int(part) for part in text.split(",")]

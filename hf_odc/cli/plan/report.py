"""Text and JSON output of a planning :class:`~hf_odc.cli.plan.simulate.Simulation`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.table import Table

from ...packing.schemes import BASELINE
from .simulate import HYBRID_SCHEMES, Simulation

__all__ = ["render_table", "write_json"]


def render_table(simulation: Simulation, console: Console | None = None) -> None:
    """Print one row per (world size, scheme): predicted bubble rate, speedup and microbatches per rank.

    Collective schemes synchronise per layer, ODC schemes per minibatch; the scheme names say which.
    """
    config = simulation.config
    caption = (
        f"{config['source']}, {config['samples_per_rank']} samples/rank, max_tokens={config['max_tokens']}, "
        f"cost={config['cost']}, {config['num_minibatches']} minibatches, seed={config['seed']}"
    )
    if "sp_size" in config:
        caption += (
            f"\nsp_size={config['sp_size']}: samples over max_tokens split over {config['sp_size']} ranks "
            "(ODC+LB-Mini: as group microbatches, counted in Microbatches/rank; the others: every microbatch split "
            "over a group)"
        )
    if "cross_host" in config:
        caption += "\n" + _cross_host_caption(simulation)
    table = Table(title=f"Predicted bubble rate and speedup over {BASELINE}", caption=caption)
    table.add_column("Ranks", justify="right")
    table.add_column("Scheme", no_wrap=True)
    table.add_column("Bubble", justify="right")
    table.add_column("Speedup", justify="right")
    table.add_column("Microbatches/rank", justify="right")
    previous_world_size = None
    for result in simulation.results:
        if previous_world_size not in (None, result.world_size):
            table.add_section()
        previous_world_size = result.world_size
        counts = f"{result.min_microbatches}-{result.max_microbatches}"
        table.add_row(
            str(result.world_size),
            result.scheme,
            f"{result.bubble_rate:.1%}",
            f"{result.speedup:.2f}x",
            str(result.min_microbatches) if result.min_microbatches == result.max_microbatches else counts,
        )
    console = console or Console()
    console.print(table)
    if simulation.groups:
        console.print(_group_table(simulation))


def _group_table(simulation: Simulation) -> Table:
    """ODC+LB-Mini's sequence-parallel groups in each world size's first minibatch: the documents each group splits,
    what they and everything else cost each rank, against the mean rank's load, and the busiest rank's over it."""
    table = Table(
        title=f"ODC+LB-Mini's group microbatches, first minibatch, sp_size={simulation.config['sp_size']}",
        caption="Documents: the lengths a group runs split over its ranks, in order, before the ranks' own "
        "microbatches. Split and Loads: their share of each rank's cost and each rank's whole cost, as fractions of "
        "the mean rank's load. Balance: the busiest rank's load over the mean (1.00x: even).",
    )
    for name, justify in (("Ranks", "right"), ("Group", "left"), ("Documents", "left"), ("Split", "right"),
                          ("Loads", "left"), ("Balance", "right")):  # fmt: skip
        table.add_column(name, justify=justify)
    for world_size, groups in simulation.groups.items():
        loads = [load for group in groups for load in group.loads]
        mean = sum(loads) / len(loads)
        for index, group in enumerate(groups):
            table.add_row(
                str(world_size) if index == 0 else "",
                f"{group.ranks[0]}-{group.ranks[-1]}",
                ", ".join(map(str, group.documents)) or "-",
                f"{group.shared_cost / mean:.0%}",
                " ".join(f"{load / mean:.0%}" for load in group.loads),
                f"{max(loads) / mean:.2f}x" if index == 0 else "",
            )
        table.add_section()
    return table


def _cross_host_caption(simulation: Simulation) -> str:
    """What the hybrid rows add and assume, and which world sizes have none: a reader comparing them with the
    compute-only baseline must know that it leaves out a flat FSDP's own cross-host traffic."""
    layout = simulation.config["cross_host"]
    gpus = layout["gpus_per_host"]
    hybrid = {result.world_size for result in simulation.results if result.scheme in HYBRID_SCHEMES}
    skipped = [size for size in simulation.config["world_sizes"] if size not in hybrid]
    text = (
        f"{' and '.join(HYBRID_SCHEMES)}: {gpus} GPUs/host, + one ring all-reduce per minibatch of each GPU's "
        f"1/{gpus} of the {layout['gradient_bytes'] / 1e9:.3g} GB fp32 gradient across the H hosts, "
        f"2(H-1)/H x shard / ({layout['bandwidth'] / 1e9:g} GB/s per GPU), 1 cost unit = "
        f"{layout['seconds_per_unit']:.3g} s. Speedups are over compute-only {BASELINE}, which leaves out a "
        "flat FSDP's cross-host collectives."
    )
    if skipped:
        text += f" No hybrid rows for {', '.join(map(str, skipped))} ranks: not several whole hosts."
    return text


def write_json(simulation: Simulation, path: str | Path | TextIO) -> None:
    """Write the configuration and every result as JSON to a file, or to an open stream such as ``sys.stdout``
    (``hf-odc plan --json -``)."""
    text = json.dumps(simulation.to_dict(), indent=2) + "\n"
    if isinstance(path, str | Path):
        Path(path).write_text(text)
    else:
        path.write(text)

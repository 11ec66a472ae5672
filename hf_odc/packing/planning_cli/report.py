"""Text and JSON output of a planning :class:`~hf_odc.packing.simulate.Simulation`."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..schemes import BASELINE
from .simulate import Simulation

__all__ = ["render_table", "write_json"]


def render_table(simulation: Simulation, console: Console | None = None) -> None:
    """Print one row per (world size, scheme): predicted bubble rate, speedup and microbatches per rank.

    Collective schemes synchronise per layer, ODC schemes per minibatch; the scheme names say which.
    """
    config = simulation.config
    table = Table(
        title=f"Predicted bubble rate and speedup over {BASELINE}",
        caption=(
            f"{config['source']}, {config['samples_per_rank']} samples/rank, max_tokens={config['max_tokens']}, "
            f"cost={config['cost']}, {config['num_minibatches']} minibatches, seed={config['seed']}"
        ),
    )
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
    (console or Console()).print(table)


def write_json(simulation: Simulation, path: str | Path) -> None:
    Path(path).write_text(json.dumps(simulation.to_dict(), indent=2) + "\n")

"""Figures for ``hf-odc plan --plot``: where the idle time goes, and how the gap grows with the world size.

matplotlib is an optional dependency (``hf-odc[plot]``), imported only here and only when a plot is asked for. The
figure is drawn on an Agg canvas directly, without pyplot, so no global backend is switched.
"""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING

from ...packing.bubble import idle_fraction, step_times, sync_time
from ...packing.schemes import BASELINE, SCHEMES
from .simulate import HYBRID_SCHEMES, Simulation

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_simulation"]

_TIMELINE_SCHEMES = (BASELINE, "ODC+LB-Mini")
_MAX_TIMELINE_RANKS = 16
_SHADES = {"layer": ("tab:blue", "tab:cyan"), "minibatch": ("tab:green", "yellowgreen")}
"""The two shades a timeline's microbatches alternate between, per sync: consecutive microbatches stay apart."""


def plot_simulation(simulation: Simulation, path: str | Path | None = None, world_size: int | None = None) -> Figure:
    """Return (and save to ``path``, if given) a figure with (a) one minibatch as per-rank timelines for
    Collective+LB-Micro and ODC+LB-Mini at ``world_size`` (default: the largest simulated one with at most 16 ranks,
    which stays legible) and (b) the predicted speedup of every scheme against the world size (the cross-host rows
    dashed, where simulated)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("Plotting needs matplotlib: pip install 'hf-odc[plot]'.") from error

    world_sizes = sorted(simulation.timelines)
    if world_size is None:
        legible = [size for size in world_sizes if size <= _MAX_TIMELINE_RANKS]
        world_size = legible[-1] if legible else world_sizes[0]
    elif world_size not in simulation.timelines:
        raise ValueError(f"world_size={world_size} was not simulated; choose one of {world_sizes}.")

    figure = Figure(figsize=(15, 7), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(2, 2, width_ratios=(3, 2))
    timeline_axes = [figure.add_subplot(grid[0, 0])]
    timeline_axes.append(figure.add_subplot(grid[1, 0], sharex=timeline_axes[0]))
    timelines = simulation.timelines[world_size]
    unit = sync_time(timelines[BASELINE], "layer")
    for axes, name in zip(timeline_axes, _TIMELINE_SCHEMES, strict=True):
        _draw_timeline(axes, name, timelines[name], unit)
    timeline_axes[-1].set_xlabel(f"time, relative to {BASELINE}'s minibatch")
    # A suptitle, unlike figure.text, gets room from the constrained layout instead of overprinting axes titles.
    figure.suptitle(f"(a) one minibatch, {world_size} ranks", x=0.01, ha="left", fontsize=12, weight="bold")
    _draw_speedups(figure.add_subplot(grid[:, 1]), simulation)
    if path is not None:
        figure.savefig(path, dpi=110)
    return figure


def _draw_timeline(axes: Axes, name: str, per_rank: list[list[float]], unit: float) -> None:
    """One row per rank; each microbatch a bar, alternating shades. Layer sync starts step ``s`` on all ranks once
    the slowest rank has finished step ``s - 1``; minibatch sync runs each rank's microbatches back to back."""
    sync = next(scheme.sync for scheme in SCHEMES if scheme.name == name)
    shades = _SHADES[sync]
    starts = list(accumulate(step_times(per_rank), initial=0.0)) if sync == "layer" else None
    for rank, costs in enumerate(per_rank):
        clock = 0.0
        for step, cost in enumerate(costs):
            if starts is not None:
                clock = starts[step]
            axes.broken_barh(
                [(clock / unit, cost / unit)], (rank - 0.4, 0.8), facecolors=shades[step % 2], edgecolor="white"
            )
            clock += cost
    end = sync_time(per_rank, sync)
    axes.axvline(end / unit, color="black", linestyle="--", linewidth=1)
    idle = idle_fraction([sum(rank) for rank in per_rank], end)
    axes.set_title(f"{name}: time {end / unit:.2f}, idle {idle:.1%}", loc="left")
    axes.set_ylabel("rank")
    axes.set_ylim(len(per_rank) - 0.5, -0.5)
    axes.set_yticks(range(len(per_rank)))
    _timeline_legend(axes, sync)


def _timeline_legend(axes: Axes, sync: str) -> None:
    """Say what the shades, the white gaps and the dashed line of a timeline are, beside it (not over the bars).
    Where the gaps fall is what tells the schemes apart: per step under layer sync, at the end under minibatch."""
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    waits = "for each step's slowest rank" if sync == "layer" else "for the busiest rank"
    handles = {
        "microbatch\n(shades alternate)": tuple(Patch(facecolor=shade) for shade in _SHADES[sync]),
        f"idle (white gap):\nwaiting {waits}": Patch(facecolor="white", edgecolor="gray"),
        "minibatch end": Line2D([], [], color="black", linestyle="--", linewidth=1),
    }
    axes.legend(
        list(handles.values()),
        list(handles),
        handler_map={tuple: HandlerTuple(ndivide=None, pad=0)},
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize="small",
    )


def _draw_speedups(axes: Axes, simulation: Simulation) -> None:
    world_sizes = sorted(simulation.timelines)
    for name in dict.fromkeys(result.scheme for result in simulation.results):
        points = sorted((result.world_size, result.speedup) for result in simulation.results if result.scheme == name)
        style = "--" if name in HYBRID_SCHEMES else "-"
        axes.plot(*zip(*points, strict=True), marker="o", linestyle=style, label=name)
    axes.axhline(1.0, color="gray", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xticks(world_sizes, [str(size) for size in world_sizes])
    axes.set_xlabel("world size (ranks)")
    axes.set_ylabel(f"predicted speedup over {BASELINE}")
    axes.set_title("(b) speedup vs world size", loc="left", fontsize=12, weight="bold")
    axes.legend()
    axes.grid(alpha=0.3)

"""What the ODC trainers print to the console: each step's logs with the per-rank values summarised.

A step's logs hold five values per rank (``busy_s/rank_R``, ``wait_s/rank_R``, ...), about 400 characters on 2 ranks
and more with every rank. transformers' console printers (``ProgressCallback``, ``PrinterCallback``) print them whole;
:data:`CONSOLE_CALLBACKS` replaces them with printers of :func:`console_logs`, each per-rank value as ``min..max``,
broken to the terminal's width. Only the console changes: the ``report_to`` loggers and ``trainer_state.json`` still
get every value.
"""

from __future__ import annotations

import math
import re
import shutil
from typing import Any

from transformers import (
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

__all__ = ["CONSOLE_CALLBACKS", "console_logs"]


_PER_RANK = re.compile(r"(.+)/rank_\d+")


def console_logs(logs: dict[str, Any]) -> dict[str, Any]:
    """What the console shows of ``logs``: each per-rank metric (``NAME/rank_R``) once, as ``NAME: "min..max"`` over
    the ranks (:func:`_span`) in the place of its first rank; not the calibration's fitted coefficients
    (``calibration/per_microbatch`` ... ``calibration/error``, which ``report_to`` and ``odc_calibration.json`` keep)
    nor ``total_flos``; other floats to 4 significant digits, as transformers prints them."""
    shown: dict[str, Any] = {}
    per_rank: dict[str, list[float]] = {}
    for key, value in logs.items():
        if (match := _PER_RANK.fullmatch(key)) is not None:
            per_rank.setdefault(match[1], []).append(value)
            shown.setdefault(match[1], None)  # holds the place, filled below
        elif key != "total_flos" and not key.startswith("calibration/"):
            shown[key] = f"{value:.4g}" if isinstance(value, float) else value
    for name, values in per_rank.items():
        shown[name] = _span(values)
    return shown


def _span(values: list[float]) -> str:
    """``"min..max"`` of ``values`` (one number when both print the same): integers as such, others with the decimals
    that give the larger of the two 3 significant digits (``"0.00006..0.00788"``, not ``"5.714e-05..0.007881"``)."""
    low, high = min(values), max(values)
    largest = max(abs(low), abs(high))
    if all(float(value).is_integer() for value in values) or largest == 0:
        decimals = 0
    else:
        decimals = max(0, 2 - math.floor(math.log10(largest)))
    low_text, high_text = f"{low:.{decimals}f}", f"{high:.{decimals}f}"
    return low_text if low_text == high_text else f"{low_text}..{high_text}"


def _console_text(logs: dict[str, Any]) -> str:
    """``str`` of :func:`console_logs`, broken between entries to fit the terminal (80 columns where there is none)."""
    width = shutil.get_terminal_size().columns
    lines, line = [], "{"
    for entry in (f"{key!r}: {value!r}" for key, value in console_logs(logs).items()):
        if line == "{":
            line += entry
        elif len(line) + len(entry) + 3 > width:  # ", " before it, "," or "}" after it
            lines.append(line + ",")
            line = " " + entry
        else:
            line += ", " + entry
    return "\n".join([*lines, line + "}"])


class _ConsoleProgressCallback(ProgressCallback):
    """transformers' progress bar, writing :func:`_console_text` of the logs above it."""

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **_) -> None:
        if state.is_world_process_zero and self.training_bar is not None and logs is not None:
            self.training_bar.write(_console_text(logs))


class _ConsolePrinterCallback(PrinterCallback):
    """transformers' printer of the logs when tqdm is disabled, printing :func:`_console_text` of them."""

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **_) -> None:
        if state.is_local_process_zero and logs is not None:
            print(_console_text(logs))


CONSOLE_CALLBACKS: dict[type[TrainerCallback], type[TrainerCallback]] = {
    ProgressCallback: _ConsoleProgressCallback,
    PrinterCallback: _ConsolePrinterCallback,
}

"""Where ``hf-odc plan`` gets sequence lengths and cost models from: files, datasets on disk, built-in shapes."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..calibration import Calibration
from ..cost import CalibratedCost, CostLike, named_cost
from ..distributions import get_distribution

__all__ = [
    "LengthPool",
    "LengthSource",
    "choose_cost",
    "choose_source",
    "load_calibration",
    "load_model_config",
    "read_dataset_lengths",
    "read_lengths_file",
]


class LengthSource(Protocol):
    """Anything minibatches of lengths can be drawn from: a :class:`LengthPool` or a built-in distribution."""

    name: str
    max_length: int

    def draw(self, n: int, rng: np.random.Generator) -> list[int]: ...


@dataclass(frozen=True)
class LengthPool:
    """Measured lengths; each minibatch is a random subset (with replacement only if the pool is too small)."""

    name: str
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError(f"{self.name} holds no lengths.")
        bad = next((length for length in self.lengths if length <= 0), None)
        if bad is not None:
            raise ValueError(f"{self.name} holds the length {bad}; lengths must be positive token counts.")

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    def draw(self, n: int, rng: np.random.Generator) -> list[int]:
        chosen = rng.choice(len(self.lengths), size=n, replace=n > len(self.lengths))
        return [self.lengths[i] for i in chosen]


def choose_source(
    distribution: str = "longalign",
    lengths_file: str | Path | None = None,
    dataset: str | Path | None = None,
    column: str | None = None,
    split: str = "train",
) -> LengthSource:
    """A lengths file if given, else a dataset on disk if given, else the built-in ``distribution``."""
    if lengths_file is not None:
        return read_lengths_file(lengths_file, column)
    if dataset is not None:
        if column is None:
            raise ValueError("A dataset needs --column: the column holding lengths, or lists/strings to take len() of.")
        return read_dataset_lengths(dataset, column, split)
    return get_distribution(distribution)


def choose_cost(
    cost: str = "attention",
    model_config: str | Path | None = None,
    calibration: str | Path | None = None,
    max_tokens: int | None = None,
) -> CostLike:
    """A calibration if one is given (its per-microbatch cost spread over ``max_tokens``, the token cap), else the
    named ``cost`` for a given model config, else ``cost``."""
    if calibration is not None:
        fitted = load_calibration(calibration)
        return fitted.amortised(max_tokens) if max_tokens is not None else fitted
    if model_config is not None:
        return named_cost(cost, load_model_config(model_config))
    return cost


def read_lengths_file(path: str | Path, column: str | None = None) -> LengthPool:
    """Lengths from a JSON list, a CSV (one column, or the one named ``column``; a header row is skipped), or a
    text file of whitespace-separated integers."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".json":
        values = json.loads(text)
        if not isinstance(values, list):
            raise ValueError(f"{path} must hold a JSON list of integers.")
    elif path.suffix == ".csv":
        values = _csv_column(list(csv.reader(text.splitlines())), column, path)
    else:
        values = text.split()
    return LengthPool(str(path), _as_ints(values, str(path)))


def read_dataset_lengths(path: str | Path, column: str, split: str = "train") -> LengthPool:
    """Lengths from a ``datasets`` dataset saved with ``save_to_disk``: the column's integers, or ``len()`` of each
    list (e.g. ``input_ids``) or string in it."""
    from datasets import DatasetDict, load_from_disk

    dataset = load_from_disk(str(path))
    if isinstance(dataset, DatasetDict):
        if split not in dataset:
            raise ValueError(f"{path} has splits {sorted(dataset)}, not {split!r}; pass --split.")
        dataset = dataset[split]
    if column not in dataset.column_names:
        raise ValueError(f"{path} has no column {column!r}; its columns are {dataset.column_names}.")
    values = [value if isinstance(value, int) else len(value) for value in dataset[column]]
    return LengthPool(f"{path}:{column}", _as_ints(values, f"{path}:{column}"))


def load_model_config(path: str | Path) -> dict[str, Any]:
    """A model's ``config.json`` (the file, or the model directory holding it) as a dict."""
    path = Path(path)
    return json.loads((path / "config.json" if path.is_dir() else path).read_text())


def load_calibration(path: str | Path) -> CalibratedCost:
    """The cost model of a calibration file: an ODC trainer's ``odc_calibration.json`` (a JSON object), or a JSON list
    of measured microbatches ``[sequences, tokens, sum_of_squared_lengths, seconds]`` to fit."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        return Calibration.from_dict(data).cost
    rows = [row for row in data if isinstance(row, list) and len(row) == 4] if isinstance(data, list) else []
    if not data or len(rows) != len(data):
        raise ValueError(
            f"{path} is neither an odc_calibration.json (a JSON object) nor a JSON list of measured microbatches "
            "[sequences, tokens, sum_of_squared_lengths, seconds]."
        )
    return Calibration.fit([(1.0, *row[:3]) for row in rows], [row[3] for row in rows]).cost


def _csv_column(rows: list[list[str]], column: str | None, path: Path) -> list[str]:
    rows = [row for row in rows if row]
    if not rows:
        raise ValueError(f"{path} is empty.")
    header = rows[0] if not _is_int(rows[0][0]) else None
    if column is not None:
        if header is None or column not in header:
            raise ValueError(f"{path} has no header column {column!r}.")
        index = header.index(column)
    elif len(rows[0]) == 1:
        index = 0
    else:
        raise ValueError(f"{path} has {len(rows[0])} columns; name the one holding lengths with --column.")
    return [row[index] for row in rows[1 if header else 0 :]]


def _as_ints(values: Sequence[Any], where: str) -> tuple[int, ...]:
    bad = next((value for value in values if isinstance(value, bool) or not _is_int(value)), None)
    if bad is not None:
        raise ValueError(f"{where} holds {bad!r}, which is not an integer length.")
    return tuple(int(float(value)) for value in values)


def _is_int(value: Any) -> bool:
    try:
        return float(value).is_integer()
    except (TypeError, ValueError):
        return False

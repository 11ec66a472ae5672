"""Where ``hf-odc plan`` gets sequence lengths and cost models from: files, datasets on disk, built-in shapes."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ...packing.calibration import Calibration
from ...packing.cost import CalibratedCost, CostLike, named_cost
from ...packing.distributions import get_distribution

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
    tokenizer: str | Path | None = None,
) -> LengthSource:
    """A lengths file if given, else a dataset on disk if given (its text or chat ``column`` tokenized by
    ``tokenizer``), else the built-in ``distribution``."""
    if tokenizer is not None and dataset is None:
        raise ValueError("--tokenizer needs --dataset: it counts the tokens of a dataset's text or chat column.")
    if lengths_file is not None:
        return read_lengths_file(lengths_file, column)
    if dataset is not None:
        if column is None:
            raise ValueError(
                "A dataset needs --column: the column holding lengths or token ids, or (with --tokenizer DIR) text "
                "or chat messages."
            )
        return read_dataset_lengths(dataset, column, split, tokenizer)
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
    if path.suffix == ".json":
        values = _load_json(path)
        if not isinstance(values, list):
            kind = _JSON_KINDS.get(type(values), "number")
            raise ValueError(f"{path} holds a JSON {kind}; it must hold a JSON list of integers.")
    elif path.suffix == ".csv":
        values = _csv_column(list(csv.reader(path.read_text().splitlines())), column, path)
    else:
        values = path.read_text().split()
    return LengthPool(str(path), _as_ints(values, str(path)))


def read_dataset_lengths(
    path: str | Path, column: str, split: str = "train", tokenizer: str | Path | None = None
) -> LengthPool:
    """Lengths from a ``datasets`` dataset saved with ``save_to_disk``: the column's integers, the number of token
    ids in each list (e.g. ``input_ids``), or, with ``tokenizer`` (a local tokenizer or model directory), the tokens
    of each text (``tokenizer(text)``, special tokens included) or chat (``apply_chat_template(messages)``).

    The column's type decides, not its first value: ``len()`` of a string counts characters and of a chat counts
    messages, so text and chats without a tokenizer are refused rather than planned as nonsense lengths.
    """
    from datasets import DatasetDict, load_from_disk

    dataset = load_from_disk(str(path))
    if isinstance(dataset, DatasetDict):
        if split not in dataset:
            raise ValueError(f"{path} has splits {sorted(dataset)}, not {split!r}; pass --split.")
        dataset = dataset[split]
    if column not in dataset.column_names:
        raise ValueError(f"{path} has no column {column!r}; its columns are {dataset.column_names}.")
    where = f"{path}:{column}"
    kind = _column_kind(dataset.features[column], f"{path} column {column!r}")
    if kind in ("text", "chat") and tokenizer is None:
        raise ValueError(
            f"{path} column {column!r} holds {_KIND_NAMES[kind]}, not lengths: add --tokenizer DIR (a local "
            f"tokenizer or model directory) to count {'its' if kind == 'text' else 'their'} tokens."
        )
    if kind not in ("text", "chat") and tokenizer is not None:
        raise ValueError(
            f"--tokenizer counts the tokens of text or chat columns; {path} column {column!r} holds "
            f"{_KIND_NAMES[kind]}, whose lengths need none: drop --tokenizer."
        )
    if kind == "token ids":
        return LengthPool(where, tuple(map(len, dataset[column])))
    if kind == "lengths":
        return LengthPool(where, _as_ints(list(dataset[column]), where))
    tokens = _load_tokenizer(tokenizer)
    if kind == "chat" and tokens.chat_template is None:
        raise ValueError(
            f"--tokenizer {tokenizer} has no chat template, and {path} column {column!r} holds chat messages."
        )
    return LengthPool(f"{where} (tokenizer {tokenizer})", _token_counts(tokens, dataset.select_columns(column), kind))


def _load_tokenizer(path: str | Path) -> Any:
    """``transformers.AutoTokenizer.from_pretrained(path)`` for a local directory. transformers is imported only
    here: planning from lengths does not need it, and a missing directory is refused before transformers would
    take it for a Hub model id."""
    if not Path(path).is_dir():
        raise ValueError(f"--tokenizer {path} is not a directory: give a local tokenizer or model directory.")
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise ImportError(f"--tokenizer needs transformers: pip install transformers ({error}).") from error
    return AutoTokenizer.from_pretrained(str(path))


def load_model_config(path: str | Path) -> dict[str, Any]:
    """A model's ``config.json`` (the file, or the model directory holding it) as a dict."""
    path = Path(path)
    return _load_json(path / "config.json" if path.is_dir() else path)


def load_calibration(path: str | Path) -> CalibratedCost:
    """The cost model of a calibration file: an ODC trainer's ``odc_calibration.json`` (a JSON object), or a JSON list
    of measured microbatches ``[sequences, tokens, sum_of_squared_lengths, seconds]`` to fit."""
    data = _load_json(Path(path))
    if isinstance(data, dict):
        return Calibration.from_dict(data).cost
    rows = [row for row in data if isinstance(row, list) and len(row) == 4] if isinstance(data, list) else []
    if not data or len(rows) != len(data):
        raise ValueError(
            f"{path} is neither an odc_calibration.json (a JSON object) nor a JSON list of measured microbatches "
            "[sequences, tokens, sum_of_squared_lengths, seconds]."
        )
    return Calibration.fit([(1.0, *row[:3], 0.0) for row in rows], [row[3] for row in rows]).cost  # no expert term


_KIND_NAMES = {
    "lengths": "integer lengths",
    "token ids": "token ids (lists of integers)",
    "text": "text (strings)",
    "chat": "chat messages (lists of {'role', 'content'} dicts)",
}
_TOKENIZE_BATCH = 1024  # samples per tokenizer call: batched for speed, bounded for memory


def _column_kind(feature: Any, where: str) -> str:
    """Which of :data:`_KIND_NAMES` a ``datasets`` column's feature is; anything else is refused, naming it."""
    from datasets import LargeList, List, Value

    if isinstance(feature, Value):
        if feature.dtype.startswith(("int", "uint", "float")):
            return "lengths"
        if feature.dtype in ("string", "large_string"):
            return "text"
    elif isinstance(feature, List | LargeList):
        item = feature.feature
        if isinstance(item, Value) and item.dtype.startswith(("int", "uint")):
            return "token ids"
        if isinstance(item, dict):
            if {"role", "content"} <= item.keys():
                return "chat"
            raise ValueError(
                f"{where} holds lists of dicts with keys {sorted(item)}, not chat messages: the messages need "
                "'role' and 'content' keys."
            )
    raise ValueError(f"{where} holds {feature}, which is none of: {', '.join(_KIND_NAMES.values())}.")


def _token_counts(tokenizer: Any, dataset: Any, kind: str) -> tuple[int, ...]:
    """The token count of each text or chat in the one column of ``dataset``, tokenized in batches."""
    counts: list[int] = []
    for batch in dataset.iter(batch_size=_TOKENIZE_BATCH):
        (values,) = batch.values()
        if kind == "text":
            ids = tokenizer(values)["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(values, tokenize=True, return_dict=False)
        counts += map(len, ids)
    return tuple(counts)


_JSON_KINDS = {dict: "object", str: "string", bool: "boolean", type(None): "null"}  # else a number


def _load_json(path: Path) -> Any:
    """The JSON in ``path``; a syntax error names the file, which :func:`json.loads` alone would not."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}.") from error


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

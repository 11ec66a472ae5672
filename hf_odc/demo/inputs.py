"""The example scripts' inputs, checked before anything is built: a model (a local directory, or a Hub name in the
cache or reachable), a dataset (a ``save_to_disk`` directory, a data file, a Hub name) and a checkpoint to resume from.

The scripts run these checks while their command line is parsed (:class:`~hf_odc.demo.ExampleParser`), before the
training config joins the process group and before a model is built, so a bad input costs seconds, not a model load
per rank. Each check raises ``ValueError`` with one line naming the flag, its value, what is wrong and what to do.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.parse
from collections.abc import Callable, Collection

import datasets
import huggingface_hub
from datasets import Dataset, load_dataset, load_from_disk
from huggingface_hub import constants
from transformers import AutoConfig

from .models import MODEL_CONFIGS
from .tokenizer import missing_tokenizer

DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
"""What ``load_dataset`` reads a data file given as ``--dataset_name`` with, by its extension."""

HUB_PROBE_TIMEOUT_S = 3.0
"""How long a script waits for a connection to the Hub before it calls the Hub unreachable (huggingface_hub itself
retries for tens of seconds before it gives up)."""

_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def is_local_path(name: str) -> bool:
    """Whether ``name`` can only mean a local path, not a Hub repository id (``name`` or ``owner/name``): it exists,
    or it is absolute, relative to ``.``, ``..`` or ``~``, or has more than one ``/``."""
    return os.path.exists(name) or name.startswith(("/", ".", "~")) or name.count("/") > 1


def hub_unreachable() -> str | None:
    """Why nothing can be downloaded from the Hub now, in words, or ``None``: offline mode (``HF_HUB_OFFLINE``), or
    no connection to the Hub's endpoint within :data:`HUB_PROBE_TIMEOUT_S` (not tried behind a proxy, which a direct
    connection does not go through)."""
    if huggingface_hub.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return None
    endpoint = urllib.parse.urlsplit(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as error:
        return f"the Hub ({endpoint.hostname}) cannot be reached: {error}"
    return None


def check_model(name: str) -> None:
    """``--model_name_or_path``: a directory holding a saved model (``config.json``) and its own tokenizer, or a Hub
    name that is in the cache or can be downloaded."""
    flag = f"--model_name_or_path {name}"
    if is_local_path(name):
        if not os.path.isdir(name):
            what = "is a file, not a model directory" if os.path.exists(name) else "no such directory"
            raise ValueError(f"{flag}: {what}; pass the directory a model was saved to (save_pretrained)")
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ValueError(f"{flag}: the directory has no config.json, so it holds no saved model; pass the "
                             "directory model.save_pretrained wrote")  # fmt: skip
        missing = missing_tokenizer(name)
        if missing:
            raise ValueError(f"{flag}: {missing}")
        _check_config(flag, lambda: AutoConfig.from_pretrained(name))
        return
    cached = huggingface_hub.try_to_load_from_cache(name, "config.json")
    if isinstance(cached, str):
        _check_config(flag, lambda: AutoConfig.from_pretrained(name))
        return
    reason = hub_unreachable()
    if reason is not None:
        raise ValueError(
            f"{flag}: no local directory of that name, and the Hub model is not in the cache "
            f"({constants.HF_HUB_CACHE}) while {reason}; download it where the Hub is reachable (hf download {name}) "
            "or pass a local directory"
        )


def check_model_config(path: str, built_in: Collection[str] = tuple(MODEL_CONFIGS)) -> None:
    """``--model_config`` naming a file: a ``config.json`` (or a directory holding one) that transformers builds a
    config from; the refusal names the script's ``built_in`` models besides."""
    flag = f"--model_config {path}"
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        what = "the directory has no config.json" if os.path.isdir(path) else "no such file or directory"
        raise ValueError(f"{flag}: {what}; name one of {', '.join(built_in)} or a config.json")
    try:
        with open(file) as f:
            raw = json.load(f)
    except (OSError, ValueError) as error:
        raise ValueError(f"{flag}: {file} is not a JSON config: {' '.join(str(error).split())}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"{flag}: {file} has no model_type; a transformers config.json names its model's type")
    _check_config(flag, lambda: AutoConfig.for_model(**raw))


def _check_config(flag: str, load: Callable[[], object]) -> None:
    """Raise ``ValueError`` in one line when transformers refuses the model's config (``load``): an unknown model
    type, or a field of the wrong type (``"router_aux_loss_coef": null``), which it would otherwise say in a
    traceback on every process once the model is built."""
    try:
        load()
    except Exception as error:  # transformers' validation errors are of many types
        raise ValueError(f"{flag}: transformers refuses its config.json: {' '.join(str(error).split())}; fix the "
                         "config (or remove the key, for its default)") from None  # fmt: skip


def require_columns(dataset: Dataset, *alternatives: tuple[str, ...], needs: str) -> None:
    """Raise ``ValueError`` unless ``dataset`` has every column of one of ``alternatives``: one line saying what the
    trainer ``needs`` (in words), the columns found, and what to do."""
    if not any(set(columns) <= set(dataset.column_names) for columns in alternatives):
        raise ValueError(f"{needs}; its columns are {dataset.column_names}. Rename the ones that hold them")


def load_dataset_input(name: str, config: str | None, split: str) -> Dataset:
    """``--dataset_name``'s split ``split`` (``--dataset_train_split``): a directory saved with ``save_to_disk``, a
    data file (by its extension, :data:`DATA_FILE_BUILDERS`), a directory of data files, or a Hub dataset (in the
    cache, or reachable). Raises ``ValueError`` in one line for one that does not exist, cannot be read, or holds no
    rows."""
    flag = f"--dataset_name {name}"
    if is_local_path(name) and not os.path.exists(name):
        raise ValueError(f"{flag}: no such file or directory")
    if not is_local_path(name) and (reason := hub_unreachable()) is not None and not huggingface_hub.is_offline_mode():
        raise ValueError(f"{flag}: no local file or directory of that name, and {reason}; pass a local path, or set "
                         "HF_HUB_OFFLINE=1 if the dataset is in the cache")  # fmt: skip
    load = _loader(name, config, flag)
    try:
        dataset = load()
    except Exception as error:  # datasets' errors for what it cannot find or read are of many types
        summary = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if "corresponds to no data" in summary:
            raise ValueError(f"{flag}: it holds no rows; point it at data with at least one sample") from None
        offline = " (HF_HUB_OFFLINE is set: is it in the cache?)" if huggingface_hub.is_offline_mode() else ""
        raise ValueError(f"{flag}: cannot be loaded{offline}: {type(error).__name__}: {summary}") from None
    if hasattr(dataset, "keys"):
        if split not in dataset:
            raise ValueError(f"{flag} has no split {split!r} (--dataset_train_split); its splits: {list(dataset)}")
        dataset = dataset[split]
    if len(dataset) == 0:
        raise ValueError(f"{flag}: its split {split!r} holds no rows; point it at data with at least one sample")
    return dataset


def _loader(name: str, config: str | None, flag: str) -> Callable[[], Dataset]:
    """How ``datasets`` loads ``name``, once what it would misreport is refused (an empty saved dataset: an
    ``IndexError``; a blank file or an unknown extension)."""
    if os.path.isdir(name) and os.path.isfile(state := os.path.join(name, "state.json")):
        with open(state) as f:
            if not json.load(f).get("_data_files"):
                raise ValueError(f"{flag}: the saved dataset holds no rows; save one with at least one sample")
        return lambda: load_from_disk(name)
    if os.path.isdir(name) and os.path.isfile(os.path.join(name, "dataset_dict.json")):
        return lambda: load_from_disk(name)
    if os.path.isfile(name):
        builder = DATA_FILE_BUILDERS.get(os.path.splitext(name)[1].lower())
        if builder is None:
            raise ValueError(f"{flag}: a data file must end in one of {', '.join(DATA_FILE_BUILDERS)}")
        if _blank(name):
            raise ValueError(f"{flag}: the file is empty (nothing but white space); it needs at least one sample")
        return lambda: load_dataset(builder, data_files=name, split="train")
    return lambda: load_dataset(name, name=config)


def _blank(path: str, chunk: int = 1 << 16) -> bool:
    """Whether the file at ``path`` holds nothing but white space (reads no further than its first other byte)."""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if block.strip():
                return False
    return True


def quiet_datasets_on_other_ranks() -> None:
    """Progress bars of ``datasets`` on the first process only: every process prepares the data alike."""
    if int(os.environ.get("RANK", "0")) != 0:
        datasets.disable_progress_bars()

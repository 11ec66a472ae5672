"""Which torch hf_odc runs on: a floor, the versions its suite has run on, and the check of the private layouts it
reads.

hf_odc reads FSDP2's private state (:mod:`hf_odc.engine._fsdp_internals`) and torch's other private names
(:mod:`hf_odc._compat`: the default store, symmetric memory...). Rather than a fixed list of versions, every such use is
checked where it happens (:func:`require` here, :mod:`hf_odc._compat`'s own check there): a torch that renamed or
dropped one fails with an error naming it, instead of computing wrong gradients. A torch newer than the newest the
suite has run on is admitted with a warning, once its layouts pass.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from ._compat import UnsupportedLibraryError

MIN_TORCH = (2, 11)
CHECKED_TORCH = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))
"""Versions the test suite passed on (docs/api.md, "Torch versions")."""

__all__ = [
    "CHECKED_TORCH",
    "MIN_TORCH",
    "UnsupportedTorchError",
    "check_torch_version",
    "require",
]


class UnsupportedTorchError(UnsupportedLibraryError):
    """This torch lacks something hf_odc relies on."""


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch_version(version: str | None = None) -> None:
    """Refuse a torch below :data:`MIN_TORCH`; warn on one newer than every version in :data:`CHECKED_TORCH`."""
    if version is None:
        import torch

        version = torch.__version__
    found = _major_minor(version)
    if found < MIN_TORCH:
        raise UnsupportedTorchError(
            f"hf_odc needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (FSDP2's custom comms), but this is torch {version}."
        )
    if found > max(CHECKED_TORCH):
        newest = ".".join(map(str, max(CHECKED_TORCH)))
        warnings.warn(
            f"hf_odc's tests last ran on torch {newest}; this is torch {version}. The private layouts it reads are "
            "checked as it goes, but run its parity tests (pytest tests/distributed/test_engine.py) before trusting "
            "the gradients.",
            stacklevel=3,
        )


def require(obj: object, names: Iterable[str], what: str) -> None:
    """Raise :class:`UnsupportedTorchError` naming the first of ``names`` that ``obj`` (described as ``what``) lacks."""
    for name in names:
        if not hasattr(obj, name):
            import torch

            raise UnsupportedTorchError(
                f"hf_odc relies on {what}.{name}, which torch {torch.__version__} does not have; this torch changed "
                f"a private layout hf_odc reads (supported: torch {MIN_TORCH[0]}.{MIN_TORCH[1]} to "
                f"{'.'.join(map(str, max(CHECKED_TORCH)))})."
            )

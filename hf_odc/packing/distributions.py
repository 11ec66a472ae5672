"""Seeded synthetic sequence-length distributions, for planning experiments without a dataset at hand.

They are *approximations* of the shapes reported for real post-training sets, not samples of them:

* ``longalign``: long-context SFT in the style of LongAlign, 8K-64K tokens, right-skewed, mean about 16.5K
  (8192 + a log-normal excess, median about 13.9K).
* ``swe-smith``: agentic coding trajectories in the style of SWE-smith, long-tailed, mean about 34.7K
  (2048 + a log-normal excess), capped at 128K (131072) tokens so that one sample fits one 128K microbatch;
  about 11% of samples are longer than 64K.
* ``uniform``: uniform over 1K-32K tokens, a control with no tail.

Log-normal tails are truncated by redrawing (not clipping), so there is no spike at the cap. Draws come from
NumPy's PCG64 generator, so a seed gives the same lengths on every machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DISTRIBUTIONS", "LengthDistribution", "get_distribution", "sample_lengths"]


@dataclass(frozen=True)
class LengthDistribution:
    """A named length distribution over ``[min_length, max_length]`` tokens."""

    name: str
    min_length: int
    max_length: int
    description: str
    _draw: Callable[[np.random.Generator, int], np.ndarray]

    def draw(self, n: int, rng: np.random.Generator) -> list[int]:
        """``n`` lengths from ``rng`` (the planning simulator draws minibatch after minibatch from one stream)."""
        return [int(length) for length in self._draw(rng, n)]


def _log_normal(offset: int, mu: float, sigma: float, high: int) -> Callable[[np.random.Generator, int], np.ndarray]:
    """``offset + LogNormal(mu, sigma)``, rounded, redrawn until ``<= high``."""

    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        kept = np.empty(0, dtype=np.int64)
        while kept.size < n:
            candidates = np.rint(offset + rng.lognormal(mu, sigma, size=n)).astype(np.int64)
            kept = np.concatenate([kept, candidates[candidates <= high]])
        return kept[:n]

    return draw


def _uniform(low: int, high: int) -> Callable[[np.random.Generator, int], np.ndarray]:
    return lambda rng, n: rng.integers(low, high, size=n, endpoint=True)


DISTRIBUTIONS: dict[str, LengthDistribution] = {
    dist.name: dist
    for dist in (
        LengthDistribution(
            "longalign", 8192, 65536, "8K-64K, right-skewed, mean ~16.5K", _log_normal(8192, 8.66, 0.9, 65536)
        ),
        LengthDistribution(
            "swe-smith",
            2048,
            131072,
            "long-tailed, mean ~34.7K, capped at 128K",
            _log_normal(2048, 10.18, 0.8, 131072),
        ),
        LengthDistribution("uniform", 1024, 32768, "uniform over 1K-32K", _uniform(1024, 32768)),
    )
}


def sample_lengths(name: str, n: int, seed: int | Sequence[int] = 0) -> list[int]:
    """``n`` sequence lengths from the built-in distribution ``name`` (see :data:`DISTRIBUTIONS`), seeded."""
    distribution = get_distribution(name)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}.")
    return distribution.draw(n, np.random.default_rng(seed))


def get_distribution(name: str) -> LengthDistribution:
    if name not in DISTRIBUTIONS:
        raise ValueError(f"Unknown length distribution {name!r}; choose one of {sorted(DISTRIBUTIONS)}.")
    return DISTRIBUTIONS[name]

"""``karmarkar_karp`` with few items per part, against the best partitions known for a fixed grid of sets.

The grid: the built-in ``longalign``, ``swe-smith`` and ``uniform`` lengths (seed ``[seed, k]``), 64-512 items,
2, 3, 4, 6 or 8 items per part (2 <= k <= 128), seeds 0-9: 540 sets. ``results/partition_best_known.json`` holds
each set's best largest part known (found once with OR-Tools CP-SAT, which hf_odc does not depend on) and the first
session's result; this script re-runs the current partitioner and prints the misses::

    python benchmarks/partition_quality.py --json partition_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from hf_odc.packing import karmarkar_karp, sample_lengths

BEST_KNOWN = Path(__file__).parent / "results" / "partition_best_known.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the per-case results here")
    args = parser.parse_args()
    known = json.loads(BEST_KNOWN.read_text())["cases"]
    results, seconds = {}, 0.0
    for key, ref in known.items():
        name, n, k, seed = key.split("/")
        n, k = int(n), int(k)
        lengths = sample_lengths(name, n, seed=[int(seed), k])
        start = time.perf_counter()
        parts = karmarkar_karp(lengths, k)
        seconds += time.perf_counter() - start
        top = max(math.fsum(lengths[i] for i in part) for part in parts)
        bound = max(math.fsum(lengths) / k, max(lengths))
        results[key] = {"top": top, "bound": bound, **ref}
    print(f"{len(results)} sets, karmarkar_karp {seconds * 1e3:.0f} ms in all")
    print(f"{'':>14} | {'misses 1% of max(sum/k, largest)':>34} | {'misses 1% of best known':>23} | worst / best known")
    for label, field in (("first session", "first_session"), ("now", "top")):
        long_tailed = [r for key, r in results.items() if not key.startswith("uniform")]
        uniform = [r for key, r in results.items() if key.startswith("uniform")]
        over_bound = [sum(r[field] > 1.01 * r["bound"] for r in group) for group in (long_tailed, uniform)]
        over_best = sum(r[field] > 1.01 * r["best_known"] for r in results.values())
        worst = max(r[field] / r["best_known"] for r in results.values())
        misses = f"{over_bound[0]}/{len(long_tailed)} long-tailed, {over_bound[1]}/{len(uniform)} uniform"
        print(f"{label:>14} | {misses:>34} | {over_best:>23} | {worst:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

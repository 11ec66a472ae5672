"""What bounding a step's collectives costs: one ``ODC.meet`` (the meeting before each collective of an ODC trainer's
step, see ``ODCRuntime.bounded``) against the smallest collective it guards, an 8-float all-reduce::

    torchrun --standalone --nproc_per_node 2 benchmarks/meeting_cost.py --json meeting_cost.json

On GPUs the meeting also waits for the device (the step reads its loss and norm on the host right after anyway).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from _common import build, init_distributed

import hf_odc


def _seconds_per_call(fn, calls: int) -> float:
    for _ in range(min(calls, 50)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.model, args.checkpointing = "tiny", False
    device = init_distributed(args)
    model, _, _ = build(args, device)
    odc = hf_odc.enable(model)
    small = torch.zeros(8, device=device)
    meet = _seconds_per_call(lambda: odc.meet("the benchmark"), args.calls)
    all_reduce = _seconds_per_call(lambda: (dist.all_reduce(small), small.sum().item()), args.calls)
    odc.close()
    if dist.get_rank() == 0:
        result = {"device": args.device_name, "world_size": dist.get_world_size(), "meet_s": meet,
                  "all_reduce_8_floats_s": all_reduce}  # fmt: skip
        print(f"{args.device_name}, {dist.get_world_size()} ranks: meet {meet * 1e6:.0f} us, 8-float all-reduce "
              f"{all_reduce * 1e6:.0f} us")  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

# Copyright 2026 The hf_odc authors. Apache-2.0.
"""A plain Accelerate training loop on ODC: the two lines marked ``ODC`` are all that differ from plain FSDP2.

Each optimizer step draws the same global minibatch on every rank (a seeded, long-tailed set of token sequences),
plans it with ``hf_odc.packing`` and runs this rank's packed microbatches. The loss of a microbatch is the *sum* of
its token losses times ``world_size / N``, ``N`` the target tokens of the whole minibatch, so the update equals
single-device training on the minibatch's mean token loss, whatever each rank's share.

```bash
python examples/accelerate_odc.py                                                    # one process (the reference)
accelerate launch --config_file examples/odc_cpu.yaml examples/accelerate_odc.py     # ODC + LB-Mini, 2 processes
HF_ODC_ENABLED=0 accelerate launch --config_file examples/odc_cpu.yaml examples/accelerate_odc.py   # FSDP2 + LB-Micro
```

With ODC disabled, ``odc.minibatch()`` only meets the other ranks at its entry and exit (so that ``odc.last`` times
both modes alike) and the model is plain FSDP2, whose per-layer collectives need the same number of microbatches on
every rank: hence LB-Micro for the baseline.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from hf_odc.accelerate_plugin import ODCPlugin, ODCRuntime
from hf_odc.packing import lb_micro, lb_mini, sample_lengths
from hf_odc.trainer import PACKED_ATTENTION

VOCAB = 128


def minibatch(step: int, size: int, max_length: int, seed: int) -> list[dict]:
    """The step's global minibatch, identical on every rank: long-tailed lengths, random tokens."""
    lengths = [max(2, round(n * max_length / 131072)) for n in sample_lengths("swe-smith", size, seed=[seed, step])]
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()} for n in lengths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--minibatch_size", type=int, default=16, help="samples per optimizer step, all ranks")
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="write the per-step loss and grad norm here (JSON)")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(args.seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation=PACKED_ATTENTION,  # each packed sample attended on its own (hf_odc.trainer.core.attention)
    )
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    odc = ODCRuntime(ODCPlugin(), accelerator)  # ODC: settings from HF_ODC_* variables
    model, optimizer = odc.prepare(model, optimizer)  # ODC: instead of accelerator.prepare(...)

    rank, world_size = accelerator.process_index, accelerator.num_processes
    plan_fn = lb_mini if odc.active else lb_micro
    pack = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    history = []
    for step in range(args.steps):
        samples = minibatch(step, args.minibatch_size, args.max_length, args.seed)
        num_targets = sum(len(s["input_ids"]) - 1 for s in samples)
        plan = plan_fn([len(s["input_ids"]) for s in samples], world_size, args.max_length)
        loss_sum = torch.zeros((), device=accelerator.device)
        with odc.minibatch():  # no collective inside: each rank runs its own number of microbatches
            for microbatch in plan[rank]:
                batch = pack([samples[i] for i in microbatch])  # one row; position_ids restart for each sample
                ids, positions, labels = (
                    batch[k].to(accelerator.device) for k in ("input_ids", "position_ids", "labels")
                )
                logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
                loss = F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=-100, reduction="sum")
                accelerator.backward(loss * world_size / num_targets)
                loss_sum += loss.detach()
        with odc.bounded("clipping and the loss reduction"):  # a dead or stalled peer is named, not waited for
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), float("inf"))
            mean_loss = accelerator.reduce(loss_sum, "sum").item() / num_targets
        optimizer.step()
        optimizer.zero_grad()
        history.append({"step": step + 1, "loss": mean_loss, "grad_norm": float(grad_norm)})
        accelerator.print(json.dumps(history[-1]))
    if args.output and accelerator.is_main_process:
        with open(args.output, "w") as f:
            json.dump(history, f)
    odc.close()  # collective: the ranks meet before tearing down
    accelerator.end_training()


if __name__ == "__main__":
    main()

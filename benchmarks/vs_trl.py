"""Stock TRL's ``SFTTrainer``, as users run it today, against ``ODCSFTTrainer``: same model, data, global batch and
optimizer, one command.

Rows:

* ``trl-default``: ``trl.SFTTrainer`` with TRL's defaults (padded batches, no packing, ``sdpa``) under Accelerate
  FSDP2 with the settings of TRL's ``accelerate_configs/fsdp2.yaml``;
* ``trl-best``: the same with ``padding_free=True``: each device's samples flattened into one row, and hf_odc's packed
  attention (``attn_implementation="odc_packed"``) registered for the stock model, since TRL's padding-free needs a
  varlen attention and flash-attn is not installed. BFD packing is not used: it turns the batch into packed rows of
  ``max_length`` tokens (and truncates what overflows), so the samples per step would no longer be the other rows';
* ``odc``: ``ODCSFTTrainer`` with its defaults (ODC, LB-Mini planned with the calibrated cost) under
  ``examples/odc.yaml`` (``examples/odc_cpu.yaml`` on CPU).

Each row is its own ``accelerate launch`` of this script (``--row``), started by the driver (this script without
``--row``), which collects each row's JSON and prints one table: the trainers cannot share a process group, as each
prepares the model its own way. Every row trains the same randomly initialised model (a shape of
``_common.MODELS``) on the same long-tailed token-id samples (lengths from ``hf_odc.packing.sample_lengths``
times ``--length-scale``, cut at ``--max-length``), read in order (``train_sampling_strategy="sequential"``), so step
``s`` of every row trains the same ``samples-per-device x processes`` samples; with AdamW (``adamw_torch``, constant
learning rate), bf16 compute with fp32 master weights on GPU (fp32 on CPU) and activation checkpointing unless
``--no-checkpointing``. ``--trl-accumulation k`` splits the stock rows' per-device samples into ``k`` forward passes
(the global batch stays the same), for data whose padded batches do not fit; ODC plans its microbatches itself.

A step is timed from the previous step's end to its own, both after ``torch.cuda.synchronize()`` (a
``TrainerCallback``), so data loading, collation and ODC's planning count; warm-up steps are not timed. Per row: the
median step time, tokens/s (the timed steps' real tokens, no padding, over their summed time), the peak memory
(``torch.cuda.max_memory_allocated``, largest rank), MFU (``hf_odc.packing.flops``: the documents' training FLOPs over
time x GPUs x the device's peak; none on CPU unless ``HF_ODC_PEAK_TFLOPS`` is set), ODC's measured bubble, and each
row's tokens/s over ``trl-best``'s and ``trl-default``'s. A row that fails (out of memory) is reported as failed and
the others still run::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 python benchmarks/vs_trl.py \\
        --num-processes 2 --model qwen2.5-1.5b --distribution longalign --samples-per-device 8 --steps 6 \\
        --trl-accumulation 4 --json vs_trl.json

On CPU (the smoke test) Accelerate cannot build an FSDP model and runs the stock rows as DDP, fp32; the numbers there
only show that every row runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import MODELS  # noqa: E402

from hf_odc.packing import DISTRIBUTIONS  # noqa: E402
from hf_odc.packing.flops import mfu, peak_flops, training_flops  # noqa: E402

ROWS = {"trl-default": "stock TRL, defaults", "trl-best": "stock TRL, padding-free", "odc": "ODC + LB-Mini"}

# TRL's accelerate_configs/fsdp2.yaml, but every rank builds the (seeded, identical) model itself: TRL's config loads
# rank 0's weights only, which needs from_pretrained, and a benchmark saves no state dict.
FSDP2_CONFIG = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: {precision}
num_machines: 1
num_processes: 2
main_process_port: 0
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: {cpu}
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(MODELS))
    parser.add_argument("--distribution", default="longalign", choices=sorted(DISTRIBUTIONS))
    parser.add_argument("--length-scale", type=float, default=1.0, help="shrink the distribution (CPU smoke runs)")
    parser.add_argument("--max-length", type=int, default=None, help="cut samples to this many tokens (default: none)")
    parser.add_argument("--samples-per-device", type=int, default=8)
    parser.add_argument("--trl-accumulation", type=int, default=1, help="forward passes per device per stock TRL step")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (>= 1; ODC fits its cost after 3)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {list(ROWS)}")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--logs", default=None, help="a folder for each row's full output (<row>.log)")
    parser.add_argument("--row", choices=sorted(ROWS), default=None, help=argparse.SUPPRESS)  # a launched row
    parser.add_argument("--row-json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rows = args.rows.split(",")
    if unknown := set(args.rows) - set(ROWS):
        parser.error(f"--rows: unknown {sorted(unknown)}; choose from {list(ROWS)}")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the first timed step starts at a warm-up step's end")
    if args.samples_per_device % args.trl_accumulation:
        parser.error("--trl-accumulation must divide --samples-per-device")
    return args


# -- one row, in each launched process ----------------------------------------------------------------------------


def build_model(args, tokenizer, attn_implementation: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = {"model_type": "qwen2", "tie_word_embeddings": True, **MODELS[args.model]}
    special = {name: getattr(tokenizer, name) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}
    config = AutoConfig.for_model(**shape, **special, max_position_embeddings=262144)
    config._attn_implementation = attn_implementation  # private: transformers.PretrainedConfig._attn_implementation
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every row
    return AutoModelForCausalLM.from_config(config)


def build_dataset(args, num_samples: int, vocab_size: int):
    from hf_odc.demo import synthetic_dataset

    longest = round(DISTRIBUTIONS[args.distribution].max_length * args.length_scale)
    dataset = synthetic_dataset(num_samples, longest, args.distribution, args.seed, vocab_size)
    if args.max_length:
        dataset = dataset.map(lambda row: {"input_ids": row["input_ids"][: args.max_length]})
    return dataset


class StepTimer:
    """Synchronised host time at each optimizer step's end, and ODC's logged bubble."""

    def __init__(self, cuda: bool):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if cuda:
                    torch.cuda.synchronize()
                timer.ends.append(time.perf_counter())

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "bubble_rate" in logs:
                    timer.bubbles.append(logs["bubble_rate"])

        self.ends: list[float] = []
        self.bubbles: list[float] = []
        self.callback = Callback()


def run_row(args) -> None:
    import torch.distributed as dist
    from trl import SFTConfig, SFTTrainer

    from hf_odc.demo import build_tokenizer
    from hf_odc.trainer import PACKED_ATTENTION, ODCSFTConfig, ODCSFTTrainer

    cuda = torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    global_batch = args.samples_per_device * world_size
    steps = args.warmup + args.steps
    tokenizer = build_tokenizer()
    stock = args.row != "odc"
    model = build_model(args, tokenizer, "sdpa" if args.row == "trl-default" else PACKED_ATTENTION)
    dataset = build_dataset(args, global_batch * steps, model.config.vocab_size)
    longest = max(map(len, dataset["input_ids"]))
    accumulation = args.trl_accumulation if stock else 1
    common = dict(
        output_dir=tempfile.mkdtemp(prefix=f"vs_trl_{args.row}_"),
        max_steps=steps,
        per_device_train_batch_size=args.samples_per_device // accumulation,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        bf16=cuda,
        gradient_checkpointing=args.checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        train_sampling_strategy="sequential",
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    if args.row == "trl-default":
        config, trainer_class = SFTConfig(**common, max_length=longest), SFTTrainer
    elif args.row == "trl-best":  # padding-free without packing does not truncate: TRL wants max_length=None
        config, trainer_class = SFTConfig(**common, max_length=None, padding_free=True), SFTTrainer
    else:
        config, trainer_class = ODCSFTConfig(**common, max_length=longest), ODCSFTTrainer
    timer = StepTimer(cuda)
    trainer = trainer_class(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[timer.callback]
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    peaks: list = [None] * world_size
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() != 0:
        return
    lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]  # as TRL prepared them
    timed = [lengths[s * global_batch : (s + 1) * global_batch] for s in range(args.warmup, steps)]
    ends = timer.ends
    record = {
        "row": args.row,
        "device_name": torch.cuda.get_device_name() if cuda else "CPU",
        "world_size": world_size,
        "step_s": [ends[s] - ends[s - 1] for s in range(args.warmup, steps)],
        "documents": timed,
        "peak_gib": max(peaks),
        "bubble": timer.bubbles[args.warmup :] if timer.bubbles else None,
        "model_config": model.config.get_text_config().to_dict(),
    }
    Path(args.row_json).write_text(json.dumps(record))


# -- the driver -----------------------------------------------------------------------------------------------------


def launch_row(args, row: str, argv: list[str], workdir: Path) -> dict:
    cuda = torch.cuda.is_available()
    if row == "odc":
        config = ROOT / "examples" / ("odc.yaml" if cuda else "odc_cpu.yaml")
    else:
        config = workdir / "fsdp2.yaml"
        config.write_text(FSDP2_CONFIG.format(precision="bf16" if cuda else "'no'", cpu=str(not cuda).lower()))
    out = workdir / f"{row}.json"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
        "--num_processes", str(args.num_processes), str(Path(__file__).resolve()), *argv,
        "--row", row, "--row-json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    print(f"== {row}: {ROWS[row]}", flush=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        (Path(args.logs) / f"{row}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not out.exists():
        output = (done.stderr + done.stdout).splitlines()
        # The rank's own exception, not the launcher's report that follows it.
        raised = [line for line in output if re.match(r"(\[rank\d+\]: )?\w+(Error|Exception): ", line)]
        error = (raised or output or ["no output"])[0][-300:]
        print(f"   failed (exit {done.returncode}): {error}", flush=True)
        return {"row": row, "error": error}
    return json.loads(out.read_text())


def summarize(record: dict) -> dict:
    if "error" in record:
        return record
    step_s, documents = record["step_s"], record["documents"]
    peak = peak_flops(record["device_name"])
    flops = training_flops((n for step in documents for n in step), record["model_config"])
    return {
        "row": record["row"],
        "step_s_median": statistics.median(step_s),
        "time_s": sum(step_s),
        "tokens_per_second": sum(map(sum, documents)) / sum(step_s),
        "peak_gib": record["peak_gib"],
        "mfu": mfu(flops, sum(step_s), record["world_size"], peak) if peak is not None else None,
        "bubble": statistics.mean(record["bubble"]) if record["bubble"] else None,
        "step_s": step_s,
        "tokens": [sum(step) for step in documents],
    }


def print_table(args, summary: dict, device: str) -> None:
    print(f"\n{args.model}, {args.distribution} x{args.length_scale:g}, {args.num_processes} x {device}, "
          f"{args.samples_per_device} samples/device, {args.steps} timed steps")  # fmt: skip
    print(f"{'row':>26} | {'step s':>7} | {'tok/s':>9} | {'GiB':>6} | {'MFU':>6} | {'bubble':>6} | "
          f"{'x best':>6} | {'x default':>9}")  # fmt: skip
    for name, row in summary.items():
        if "error" in row:
            print(f"{ROWS[name]:>26} | failed: {row['error'][:90]}")
            continue
        values = [row["step_s_median"], row["tokens_per_second"], row["peak_gib"], row["mfu"], row["bubble"]]
        values += [row.get("x_trl-best"), row.get("x_trl-default")]
        specs = ["7.3f", "9.0f", "6.2f", "6.1%", "6.1%", "6.3f", "9.3f"]
        cells = [format(v if v is not None else float("nan"), spec) for v, spec in zip(values, specs, strict=True)]
        print(f"{ROWS[name]:>26} | " + " | ".join(cells))


def main() -> None:
    args = parse_args()
    if args.row is not None:
        run_row(args)
        return
    argv = sys.argv[1:]
    summary, device = {}, None
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as workdir:
        for row in args.rows:
            record = launch_row(args, row, argv, Path(workdir))
            device = record.get("device_name", device)
            summary[row] = summarize(record)
    for row in summary.values():
        for ref in ("trl-best", "trl-default"):
            if "error" not in row and ref in summary and "error" not in summary[ref]:
                row[f"x_{ref}"] = row["tokens_per_second"] / summary[ref]["tokens_per_second"]
    print_table(args, summary, device or "?")
    if args.json:
        record = {"args": vars(args), "device": device, "torch": torch.__version__, "rows": summary}
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

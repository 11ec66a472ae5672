# Copyright 2026 The hf_odc authors. Apache-2.0.
"""Supervised fine-tuning with On-Demand Communication (ODC) and LB-Mini, in TRL's script style.

With no argument it runs on CPU in well under two minutes: a tiny Llama-style model built from a config, a word-level
tokenizer with a chat template built in code, and a built-in chat dataset with long-tailed lengths. Each optimizer step
takes `--global_batch_size` samples (16) whatever the number of processes, so the runs below train on the same
minibatches and match step for step (loss and gradient norm, up to floating-point summation order).

```bash
# one process (the single-device reference)
python examples/sft.py

# two CPU processes, ODC + LB-Mini
accelerate launch --config_file examples/odc_cpu.yaml examples/sft.py

# the plain-FSDP2 baseline: every rank runs the same number of microbatches
accelerate launch --config_file examples/odc_cpu.yaml examples/sft.py --odc false --balance lb-micro

# GPUs: a randomly initialised Qwen2-0.5B-shaped model on long-tailed synthetic data, bf16 (hf_odc's packed attention,
# "odc_packed", by default; --attn_implementation flash_attention_2 where flash-attn is installed)
accelerate launch --config_file examples/odc.yaml --num_processes 2 examples/sft.py \
    --model_config qwen2-0.5b --dataset synthetic-longtail --num_samples 4096 --max_length 16384 \
    --per_device_train_batch_size 16 --max_steps 20

# a real model and dataset from local disk (no Hub access needed)
accelerate launch --config_file examples/odc.yaml examples/sft.py \
    --model_name_or_path /models/Qwen2.5-0.5B-Instruct --dataset_name /data/my_chats --assistant_only_loss true
```
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import datasets
import numpy as np
import torch
from datasets import Dataset, load_dataset, load_from_disk
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    TrainingArguments,
)
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from hf_odc.packing import DISTRIBUTIONS, sample_lengths
from hf_odc.trainer import PACKED_ATTENTION, ODCSFTConfig, ODCSFTTrainer
from hf_odc.trainer.data import require_sft_columns

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ROLES = ["system", "user", "assistant"]
NUM_WORDS = 500
# ChatML, with the assistant's reply and its end-of-turn token inside {% generation %} so that TRL's
# `assistant_only_loss` trains exactly those tokens (including the one that stops generation).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MODEL_CONFIGS = {
    # Llama rather than Qwen2: `AutoTokenizer` loads the tokenizer saved beside a qwen2 config as Qwen2's byte-level
    # BPE whatever class the tokenizer's config names (transformers 5.23 overrides it for that model type), which
    # drops every word of this word-level vocabulary; beside a llama config it loads the class saved.
    "tiny": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # The shape of Qwen2-0.5B (random weights): what `hf_odc.packing.DEFAULT_ATTENTION_SHAPE` models.
    "qwen2-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
    # The shape of Qwen2.5-1.5B (random weights).
    "qwen2.5-1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
}


@dataclass
class ODCScriptArguments(ScriptArguments):
    """TRL's script arguments, plus the built-in model and datasets of this example.

    Args:
        dataset (`str`, *optional*, defaults to `"chat-longtail"`):
            Built-in dataset used when `dataset_name` is not set: `"chat-longtail"` (conversations in `messages`
            format, long-tailed reply lengths) or `"synthetic-longtail"` (pre-tokenized random token ids, lengths from
            `length_distribution` scaled to `max_length`; fast to build at any length).
        num_samples (`int`, *optional*, defaults to `512`):
            Number of samples of the built-in dataset.
        length_distribution (`str`, *optional*, defaults to `"swe-smith"`):
            Shape of the built-in datasets' lengths: one of `hf_odc.packing.DISTRIBUTIONS`, rescaled so that its
            longest sample is `max_length` tokens.
        model_config (`str`, *optional*, defaults to `"tiny"`):
            Model built from a config, with random weights, when `model_name_or_path` is not set: `"tiny"` (Llama),
            `"qwen2-0.5b"`, `"qwen2.5-1.5b"`, or a path to a `config.json` (a file or a directory holding one).
        global_batch_size (`int`, *optional*, defaults to `16`):
            Samples per optimizer step over all processes: each process gets `global_batch_size / processes`
            (`per_device_train_batch_size`), so that one process and several train on the same minibatches. Set
            this or `--per_device_train_batch_size`, not both.
    """

    dataset: str = field(
        default="chat-longtail",
        metadata={
            "help": "Built-in dataset when dataset_name is unset.",
            "choices": ["chat-longtail", "synthetic-longtail"],
        },
    )
    num_samples: int = field(default=512, metadata={"help": "Number of samples of the built-in dataset."})
    length_distribution: str = field(
        default="swe-smith",
        metadata={"help": "Length shape of the built-in datasets.", "choices": sorted(DISTRIBUTIONS)},
    )
    model_config: str = field(
        default="tiny",
        metadata={
            "help": "Model config when model_name_or_path is unset: 'tiny', 'qwen2-0.5b', 'qwen2.5-1.5b' or a path."
        },
    )
    global_batch_size: int = field(
        default=16,
        metadata={
            "help": "Samples per optimizer step over all processes (per_device_train_batch_size = this / processes). "
            "Exclusive with per_device_train_batch_size."
        },
    )


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``w0 .. w{NUM_WORDS-1}``, the role names and ChatML's special tokens."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + ROLES + [f"w{i}" for i in range(NUM_WORDS)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def longtail_lengths(num_samples: int, max_length: int, distribution: str, seed: int) -> list[int]:
    """Lengths of ``distribution`` rescaled so that its longest possible sample has ``max_length`` tokens."""
    scale = max_length / DISTRIBUTIONS[distribution].max_length
    return [max(8, round(length * scale)) for length in sample_lengths(distribution, num_samples, seed)]


def chat_dataset(num_samples: int, max_length: int, distribution: str, seed: int) -> Dataset:
    """Conversations whose total length follows ``distribution``; the assistant echoes the user's words in reverse,
    so there is something to learn. Template overhead (role tokens) is included in the length budget."""
    rng = np.random.default_rng(seed)
    rows = []
    for length in longtail_lengths(num_samples, max_length, distribution, seed):
        words = max(2, length - 6)  # 6 template tokens: <|im_start|> role <|im_end|>, twice
        prompt = [f"w{i}" for i in rng.integers(0, NUM_WORDS, size=max(1, words // 3))]
        reply = [prompt[::-1][i % len(prompt)] for i in range(words - len(prompt))]
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": " ".join(prompt)},
                    {"role": "assistant", "content": " ".join(reply)},
                ]
            }
        )
    return Dataset.from_list(rows)


def synthetic_dataset(num_samples: int, max_length: int, distribution: str, seed: int, vocab_size: int) -> Dataset:
    """Pre-tokenized random token ids (TRL trains on every token): only the lengths matter for balancing."""
    rng = np.random.default_rng(seed)
    low = len(SPECIAL_TOKENS)
    ids = [
        rng.integers(low, vocab_size, size=n).tolist()
        for n in longtail_lengths(num_samples, max_length, distribution, seed)
    ]
    return Dataset.from_dict({"input_ids": ids})


def build_model(
    script_args: ODCScriptArguments, model_args: ModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int
) -> PreTrainedModel:
    """A pretrained model from ``model_name_or_path``, else a randomly initialised one from ``model_config`` with
    ``tokenizer``'s special tokens (TRL would otherwise align them itself, saying so on every process)."""
    attn = model_args.attn_implementation or PACKED_ATTENTION
    dtype = getattr(torch, model_args.dtype) if model_args.dtype not in (None, "auto") else torch.float32
    if model_args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path, dtype=dtype, attn_implementation=attn
        )
    if script_args.model_config in MODEL_CONFIGS:
        raw = {"vocab_size": len(tokenizer), "max_position_embeddings": 4096, "tie_word_embeddings": True}
        raw |= MODEL_CONFIGS[script_args.model_config]
    else:
        path = script_args.model_config
        with open(os.path.join(path, "config.json") if os.path.isdir(path) else path) as f:
            raw = json.load(f)
    raw |= {name: getattr(tokenizer, name) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}
    config = AutoConfig.for_model(**raw)
    config._attn_implementation = attn
    torch.manual_seed(seed)  # same initial weights on every rank
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def save_initial_model(model: PreTrainedModel, path: str, training_args: TrainingArguments) -> None:
    """Save the freshly built ``model`` (the same on every rank) in ``path`` and name it by that absolute path, for
    what must load it again by name: a LoRA adapter's ``base_model_name_or_path`` (PEFT records the model's name; a
    model built from a config has none, so ``AutoPeftModelForCausalLM`` would look for a null name on the Hub) and
    GRPO's reference model (TRL loads it from the policy's name)."""
    path = os.path.abspath(path)
    with training_args.main_process_first(desc=f"saving the initial model in {path}"):
        if training_args.process_index == 0:
            model.save_pretrained(path)
    model.name_or_path = model.config._name_or_path = path


def load_train_dataset(script_args: ODCScriptArguments, training_args: ODCSFTConfig, vocab_size: int) -> Dataset:
    """``--dataset_name`` (a directory saved with ``save_to_disk``, a data file, or a dataset ``load_dataset`` finds),
    its ``--dataset_train_split``; else the built-in ``--dataset``. A dataset SFT cannot train on ends the run with one
    line naming it, the columns expected and the columns found."""
    if script_args.dataset_name:
        name = script_args.dataset_name
        if os.path.isdir(name) and any(
            os.path.exists(os.path.join(name, f)) for f in ("dataset_dict.json", "state.json")
        ):
            dataset = load_from_disk(name)
        elif os.path.isfile(name):
            builder = DATA_FILE_BUILDERS.get(os.path.splitext(name)[1].lower())
            if builder is None:
                fail(f"--dataset_name {name}: a data file must end in one of {', '.join(DATA_FILE_BUILDERS)}")
            if os.path.getsize(name) == 0:
                fail(f"--dataset_name {name}: the file is empty")
            dataset = load_dataset(builder, data_files=name, split="train")
        else:
            dataset = load_dataset(name, name=script_args.dataset_config)
        if hasattr(dataset, "keys"):
            if script_args.dataset_train_split not in dataset:
                fail(f"--dataset_name {name} has no split {script_args.dataset_train_split!r} (--dataset_train_split); "
                     f"its splits: {list(dataset)}")  # fmt: skip
            dataset = dataset[script_args.dataset_train_split]
        try:
            require_sft_columns(dataset, training_args.dataset_text_field)
        except ValueError as error:
            fail(f"--dataset_name {name}: {error}")
        return dataset
    max_length = training_args.max_length or 1024
    if script_args.dataset == "synthetic-longtail":
        return synthetic_dataset(
            script_args.num_samples, max_length, script_args.length_distribution, training_args.seed, vocab_size
        )
    return chat_dataset(script_args.num_samples, max_length, script_args.length_distribution, training_args.seed)


def load_tokenizer(model_args: ModelConfig) -> PreTrainedTokenizerFast:
    """The model directory's tokenizer if it has one, else the built-in word-level one."""
    path = model_args.model_name_or_path
    config_file = os.path.join(path or "", "tokenizer_config.json")
    if not path or not os.path.exists(config_file):
        return build_tokenizer()
    with open(config_file) as f:
        generic = json.load(f).get("tokenizer_class") == "TokenizersBackend"
    # transformers 5 may rebuild a generic tokenizer.json as the model type's tokenizer class (Qwen2's byte-level BPE
    # for the outputs of this example's Qwen2-shaped models), which breaks a word-level vocabulary; load it as it is.
    return PreTrainedTokenizerFast.from_pretrained(path) if generic else AutoTokenizer.from_pretrained(path)


def main(script_args: ODCScriptArguments, training_args: ODCSFTConfig, model_args: ModelConfig) -> None:
    if training_args.process_index != 0:
        datasets.disable_progress_bars()  # every process prepares the dataset alike: the first one shows it
    tokenizer = load_tokenizer(model_args)
    model = build_model(script_args, model_args, tokenizer, seed=training_args.seed)
    dataset = load_train_dataset(script_args, training_args, vocab_size=model.config.get_text_config().vocab_size)
    peft_config = get_peft_config(model_args)
    if peft_config is not None and not model_args.model_name_or_path:
        save_initial_model(model, os.path.join(training_args.output_dir, "base_model"), training_args)
    trainer = ODCSFTTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    train_and_save(trainer)


def train_and_save(trainer) -> None:
    """Train (resuming if asked), save the model and the trainer state, then release ODC and the process group."""
    output_dir = trainer.args.output_dir
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model(output_dir)
    trainer.save_state()
    trainer.accelerator.print(f"Training completed; model saved to {output_dir}.")
    trainer.end()  # release ODC, finish the trackers, destroy the process group


_UNSET = object()

CHECKPOINT_FLAGS = frozenset({"save_steps", "save_total_limit", "save_only_model", "save_on_each_node"})
"""Flags that configure checkpoints: any of them switches saving on unless ``--save_strategy`` is given."""

ERROR_GRACE_S = 10.0
"""How long a process other than the first waits before exiting on a bad flag (the launcher ends it sooner, once the
first one has printed the error and exited)."""

DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
"""What ``load_dataset`` reads a data file given as ``--dataset_name`` with, by its extension."""


def _leave_the_error_to_the_first_process() -> None:
    """In a process other than the first, wait and exit (status 2): under ``accelerate launch`` every process meets
    the same error, and one message is enough."""
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(ERROR_GRACE_S)  # the first process prints; the launcher ends this one when that one exits
        raise SystemExit(2)


def fail(message: str) -> NoReturn:
    """End the run with one error line, ``<script>: error: <message>``, from the first process only (as a bad flag
    does)."""
    _leave_the_error_to_the_first_process()
    sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: {message}\n")
    raise SystemExit(2)


class ExampleParser(TrlParser):
    """TRL's parser for the examples: the defaults they share, and what their command lines need.

    * Flags that imply others are completed before the configs are built (:meth:`complete`, from the flags given on
      the command line or in ``--config``): any checkpoint flag (:data:`CHECKPOINT_FLAGS`) switches saving on
      (``save_strategy="steps"``; the demos default to ``"no"``) unless ``--save_strategy`` is given.
    * A bad flag (unknown, unparsable, or refused by a config's checks) ends the run with argparse's short usage line
      and one error line, exit status 2, from the first process only: under ``accelerate launch`` every process
      parses the same flags, and each would print its traceback (the usage alone lists every TRL flag).
    * Gradient checkpointing is off by default: TRL turns it on, which only costs time on models this small.
      ``--gradient_checkpointing true`` turns it on (recent transformers renamed it ``--activation_checkpointing``;
      the ODC configs take either name without a warning).
    * LoRA's dropout defaults to 0 (TRL: 0.05): each process draws its own dropout masks, so with dropout one
      process and several would not train alike.
    """

    def __init__(self, dataclass_types: Iterable[type]):
        super().__init__(dataclass_types, usage="%(prog)s [--FLAG VALUE ...]  (--help lists the flags)")
        self.set_defaults(
            logging_steps=1, save_strategy="no", report_to="none", gradient_checkpointing=None, lora_dropout=0.0
        )
        self._from_config: set[str] = set()

    def parse_args_and_config(self, args: Iterable[str] | None = None) -> tuple[Any, ...]:
        """The configs, or :meth:`error` for flags that are unknown (here or in ``--config``) or that a config's
        ``__post_init__`` refuses (a ``ValueError``)."""
        try:
            *configs, unknown = super().parse_args_and_config(args, return_remaining_strings=True)
        except ValueError as error:
            self.error(str(error))
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return tuple(configs)

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        self._from_config = set(kwargs)  # the --config file's settings count as given
        return super().set_defaults_with_config(**kwargs)

    def parse_known_args(
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, remaining = super().parse_known_args(args, namespace)
        # Parsed again over a namespace already holding every name: argparse then leaves alone what was not given.
        unset = argparse.Namespace(**{action.dest: _UNSET for action in self._actions})
        given = {name for name, value in vars(super().parse_known_args(args, unset)[0]).items() if value is not _UNSET}
        self.complete(parsed, given | self._from_config)
        return parsed, remaining

    def complete(self, namespace: argparse.Namespace, given: set[str]) -> None:
        """Complete ``namespace`` from the names of the flags ``given``."""
        if "save_strategy" not in given and given & CHECKPOINT_FLAGS:
            namespace.save_strategy = "steps"

    def error(self, message: str) -> NoReturn:
        _leave_the_error_to_the_first_process()
        super().error(message)


class SFTParser(ExampleParser):
    """:class:`ExampleParser` for this script: the global minibatch (``--global_batch_size``) is the same whatever the
    number of processes, unless ``--per_device_train_batch_size`` is given."""

    def complete(self, namespace: argparse.Namespace, given: set[str]) -> None:
        super().complete(namespace, given)
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        if "per_device_train_batch_size" in given:
            if "global_batch_size" in given:
                self.error("set --global_batch_size or --per_device_train_batch_size, not both")
            namespace.global_batch_size = namespace.per_device_train_batch_size * processes
            return
        if namespace.global_batch_size < processes or namespace.global_batch_size % processes:
            self.error(
                f"--global_batch_size {namespace.global_batch_size} is not a positive multiple of the number of "
                f"processes ({processes}); pick one that is, or set --per_device_train_batch_size"
            )
        namespace.per_device_train_batch_size = namespace.global_batch_size // processes


def make_parser() -> SFTParser:
    parser = SFTParser((ODCScriptArguments, ODCSFTConfig, ModelConfig))
    # Defaults for the no-argument CPU demo; every one of them can be overridden on the command line.
    parser.set_defaults(output_dir="odc-sft-output", max_length=256, max_steps=30, learning_rate=3e-3)
    return parser


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)

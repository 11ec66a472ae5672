"""The demos' built-in datasets, long-tailed like real post-training data: chats and pre-tokenized samples for SFT,
prompts asking for replies of a given length for GRPO, preference pairs for DPO and reward modelling, unpaired
examples for KTO. Lengths follow
:data:`hf_odc.packing.DISTRIBUTIONS`, rescaled."""

from __future__ import annotations

import numpy as np
from datasets import Dataset

from ..packing import DISTRIBUTIONS, sample_lengths
from .tokenizer import NUM_WORDS, SPECIAL_TOKENS


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


def prompt_dataset(num_prompts: int, max_completion_length: int, distribution: str, seed: int) -> Dataset:
    """Prompts "reply with N words from: w.. w.." (conversational), with the asked length N long-tailed."""
    rng = np.random.default_rng(seed)
    rows = []
    for target in longtail_lengths(num_prompts, max_completion_length, distribution, seed):
        words = [f"w{i}" for i in rng.integers(0, NUM_WORDS, size=int(rng.integers(4, 12)))]
        content = " ".join(words)
        rows.append({"prompt": [{"role": "user", "content": content}], "target_length": target})
    return Dataset.from_list(rows)


_PAIR_TEMPLATE_TOKENS = 7  # <|im_start|> user <|im_end|> <|im_start|> assistant, and <|im_end|> after each reply


def preference_dataset(num_pairs: int, max_length: int, distribution: str, seed: int) -> Dataset:
    """Conversational preference pairs (TRL's ``prompt`` / ``chosen`` / ``rejected``): the user lists words; the
    chosen reply repeats them in reverse, the rejected one is random words. Each sequence's length (prompt, reply and
    template tokens) follows ``distribution``, drawn independently for the chosen and the rejected reply."""
    rng = np.random.default_rng(seed)
    lengths = longtail_lengths(2 * num_pairs, max_length, distribution, seed)
    rows = []
    for chosen_length, rejected_length in zip(lengths[::2], lengths[1::2], strict=True):
        prompt = [f"w{i}" for i in rng.integers(0, NUM_WORDS, size=int(rng.integers(2, 8)))]
        overhead = len(prompt) + _PAIR_TEMPLATE_TOKENS
        chosen = [prompt[::-1][i % len(prompt)] for i in range(max(1, chosen_length - overhead))]
        rejected = [f"w{i}" for i in rng.integers(0, NUM_WORDS, size=max(1, rejected_length - overhead))]
        rows.append(
            {
                "prompt": [{"role": "user", "content": " ".join(prompt)}],
                "chosen": [{"role": "assistant", "content": " ".join(chosen)}],
                "rejected": [{"role": "assistant", "content": " ".join(rejected)}],
            }
        )
    return Dataset.from_list(rows)


def unpaired_dataset(num_examples: int, max_length: int, distribution: str, seed: int) -> Dataset:
    """Conversational unpaired preference examples (TRL's ``prompt`` / ``completion`` / ``label``), one from each of
    :func:`preference_dataset`'s pairs: its chosen reply, desirable, or its rejected one, undesirable, at random."""
    pairs = preference_dataset(num_examples, max_length, distribution, seed)
    desirable = np.random.default_rng(seed + 1).random(num_examples) < 0.5
    return Dataset.from_list(
        [
            {"prompt": pair["prompt"], "completion": pair["chosen" if label else "rejected"], "label": bool(label)}
            for pair, label in zip(pairs, desirable, strict=True)
        ]
    )

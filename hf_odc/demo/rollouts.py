"""Completions drawn instead of generated, for GRPO runs that measure or compare policy updates: the same rollouts
whatever the number of ranks, with no generation time."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from .data import longtail_lengths
from .tokenizer import SPECIAL_TOKENS
from .vision import VISION_TOKENS


class SyntheticRollouts:
    """TRL's ``rollout_func``: completions drawn, not generated, reproducibly wherever they are drawn.

    A completion's length and tokens come from a generator seeded by ``seed``, its prompt's text and its index in
    the prompt's group of ``num_generations`` (from its global position, ``rank * len(prompts) + i``, the layout of
    TRL's ``RepeatSampler``). It ends with the end-of-sequence token unless it reaches ``max_completion_length``.
    ``mode`` ``"synthetic"`` draws lengths from ``distribution`` scaled to ``max_completion_length``; ``"skewed"``
    gives every completion drawn on rank 0 a long length and every other rank's a short one.
    """

    def __init__(self, mode: str, distribution: str, seed: int):
        self.mode, self.distribution, self.seed = mode, distribution, seed

    def __call__(self, prompts: list, trainer: Any) -> dict[str, Any]:
        tokenizer = trainer.processing_class
        texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
        prompt_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        return {"prompt_ids": prompt_ids, "completion_ids": self._draw(texts, trainer), "logprobs": None}

    def complete(self, prompt_ids: list[list[int]], trainer: Any) -> list[list[int]]:
        """The completions of this rank's tokenised prompts, as a generator returns them (token ids, unpadded), each
        seeded by its prompt's tokens: what a trainer without ``rollout_func`` (RLOO) can be given in place of
        ``_generate_single_turn``'s."""
        return self._draw([str(list(ids)) for ids in prompt_ids], trainer)

    def replace_decoding(self, trainer: Any) -> None:
        """Make ``trainer`` (a TRL trainer without ``rollout_func``: RLOO, distillation) take :meth:`complete`'s
        completions in place of its ``_generate_single_turn``'s decoding; the rest of its generation path (prompt
        tokenization, metrics, scoring) is unchanged."""
        trainer._generate_single_turn = lambda prompt_ids, *args, **kwargs: self.complete(prompt_ids, trainer)

    def _draw(self, keys: list[str], trainer: Any) -> list[list[int]]:
        """One completion per prompt, seeded by ``seed``, the prompt's ``key`` and its index in its group."""
        processor, args = trainer.processing_class, trainer.args
        tokenizer = getattr(processor, "tokenizer", processor)  # a vision-language policy's processor's
        rank = trainer.accelerator.process_index
        # one completion per prompt where the trainer has no groups (distillation)
        num_generations = getattr(trainer, "num_generations" if trainer.model.training else "num_generations_eval", 1)
        # after the special tokens and role names, and a processor's vision tokens (TRL never samples an image token)
        low = len(SPECIAL_TOKENS) + 3 + (len(VISION_TOKENS) if tokenizer is not processor else 0)
        vocab = len(tokenizer)
        completion_ids = []
        for i, key in enumerate(keys):
            index = (rank * len(keys) + i) % num_generations
            seed = zlib.crc32(f"{self.seed}|{key}|{index}".encode())
            rng = np.random.default_rng(seed)
            limit = args.max_completion_length
            if self.mode == "skewed":
                length = (
                    int(limit * rng.uniform(0.8, 1.0)) if rank == 0 else max(2, int(limit * rng.uniform(0.02, 0.1)))
                )
            else:
                length = longtail_lengths(1, limit, self.distribution, seed % 2**31)[0]
            tokens = rng.integers(low, vocab, size=length).tolist()
            if length < limit:
                tokens[-1] = tokenizer.eos_token_id
            completion_ids.append(tokens)
        return completion_ids

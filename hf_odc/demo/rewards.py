"""The GRPO demo's two rule-based rewards, in TRL's reward-function signature: the reply's length close to the asked
length (the prompt's ``target_length`` column), and the reply's words taken from the prompt."""

from __future__ import annotations

from typing import Any


def _text(completion: Any) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def length_reward(completions: list, target_length: list[int], **kwargs: Any) -> list[float]:
    """1 when the reply has the asked number of words, falling linearly to 0 at twice or zero that length."""
    return [
        max(0.0, 1.0 - abs(len(_text(c).split()) - target) / target)
        for c, target in zip(completions, target_length, strict=True)
    ]


def echo_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """The fraction of the reply's words that appear in the prompt."""
    rewards = []
    for prompt, completion in zip(prompts, completions, strict=True):
        allowed, words = set(_text(prompt).split()), _text(completion).split()
        rewards.append(sum(word in allowed for word in words) / len(words) if words else 0.0)
    return rewards

"""The tool-calling demo's parts (``examples/grpo_tools.py``, the GRPO notebook, ``tests/support/_grpo_tools.py``): a
tool, the demo tokenizer with a tool role and a chat template that renders tool calls, and a **scripted policy**.

A randomly initialised model never writes a well-formed tool call, so TRL's tool loop would never run. The scripted
policy is a demo device standing in for a model that has learnt to call tools: :class:`_ScriptedToolCalls`, a logits
processor that :func:`scripted_generation` adds to every ``generate`` call, forces each token of a script
(:class:`LookupScript`): tool calls in the chat template's format, then an answer. Everything after the tokens is
real: TRL parses the calls (``tokenizer.parse_response``), runs the tool, appends its result to the completion and
generates the next turn; the trainer scores the completions, masks the tool results out of the loss (TRL's
``tool_mask``) and updates the model. The forced tokens do not depend on the weights, so the scripted rollouts do not
improve as it trains. With a real model, which writes its own calls in its own chat template, none of this is needed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast
from transformers.generation import GenerationMixin

from .tokenizer import NUM_WORDS, build_tokenizer

TOOL_WORDS = ["tool", "<tool_call>", "</tool_call>", "lookup", "word"]
"""The tool-calling demo's tokens beyond the demo tokenizer's: the tool role, the call's delimiters, the tool's name and
its argument's name."""

# ChatML with tool calls: an assistant message's calls follow its content as `<tool_call> NAME KEY VALUE ...
# </tool_call>`; a tool's result is a message of the role `tool`.
_TOOL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{{ ' <tool_call> ' + call['function']['name'] }}"
    "{% for key, value in call['function']['arguments'].items() %}{{ ' ' + key + ' ' + value }}{% endfor %}"
    "{{ ' </tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """The demo's word-level tokenizer (:func:`~hf_odc.demo.build_tokenizer`) with :data:`TOOL_WORDS` and
    :data:`_TOOL_CHAT_TEMPLATE`; its ``parse_response`` reads a completion's tool calls back (TRL parses completions
    with it when the tokenizer has a ``response_template``)."""
    tokenizer = build_tokenizer(TOOL_WORDS, _TOOL_CHAT_TEMPLATE)
    tokenizer.response_template = "scripted"
    tokenizer.parse_response = lambda ids, prefix=None, tools=None: parse_tool_calls(tokenizer, ids)
    return tokenizer


def parse_tool_calls(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> dict:
    """An assistant message: its ``<tool_call> NAME KEY VALUE ... </tool_call>`` call, or its text."""
    tokens = tokenizer.convert_ids_to_tokens(list(ids))
    if "<tool_call>" not in tokens or "</tool_call>" not in tokens:
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    start, end = tokens.index("<tool_call>"), tokens.index("</tool_call>")
    name, *pairs = tokens[start + 1 : end]
    arguments = dict(zip(pairs[::2], pairs[1::2], strict=True))
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def lookup(word: str) -> str:
    """Look a word up.

    Args:
        word: The word to look up.
    """
    number = int(word[1:])
    return " ".join(f"w{(200 + 3 * number + j) % NUM_WORDS}" for j in range(3))


def tool_use_reward(completions: list, **kwargs: Any) -> list[float]:
    """The number of tool results in each completion that are not an error: what the demo rewards is calling the
    tool."""
    return [
        float(sum(message["role"] == "tool" and "error" not in message["content"] for message in completion))
        for completion in completions
    ]


def headers(tokens: list[str], role: str) -> list[int]:
    """Where each ``<|im_start|> role`` header starts in ``tokens``."""
    return [i for i, pair in enumerate(itertools.pairwise(tokens)) if pair == ("<|im_start|>", role)]


@dataclass
class LookupScript:
    """The scripted policy's turns: the ``g``-th generation of a prompt (its row modulo ``num_generations`` in the
    first turn; read back from its first tool call's argument in later turns, where TRL generates for the rows that
    called a tool only) calls :func:`lookup` ``min(g, max_calls)`` times, one call per turn, then answers
    ``words_per_turn * (1 + g + turn)`` words. A prompt of at most ``short_prompt`` words calls it at most once (so
    that rollouts of different prompts run different numbers of turns).

    Args:
        num_generations: GRPO's group size.
        max_calls: Most calls a rollout makes (``None``: ``g``).
        words_per_turn: Scale of the answers' lengths.
        short_prompt: Prompt length (in words) at or under which a rollout calls the tool at most once.
    """

    num_generations: int
    max_calls: int | None = None
    words_per_turn: int = 1
    short_prompt: int = 0

    def __call__(self, tokens: list[str], row: int) -> list[str]:
        """The tokens the assistant writes in this turn, ``tokens`` being the conversation so far (ending with the
        turn's assistant header) and ``row`` its row in the ``generate`` batch."""
        turn = len(headers(tokens, "tool"))
        g = row % self.num_generations if turn == 0 else int(tokens[tokens.index("<tool_call>") + 3][1:])
        user = headers(tokens, "user")[0]
        calls = g if self.max_calls is None else min(g, self.max_calls)
        if tokens.index("<|im_end|>", user) - user - 2 <= self.short_prompt:
            calls = min(calls, 1)
        if turn < calls:
            return ["<tool_call>", "lookup", "word", f"w{g}", "</tool_call>", "<|im_end|>"]
        words = self.words_per_turn * (1 + g + turn)
        return [f"w{(100 + 10 * g + turn + j) % NUM_WORDS}" for j in range(words)] + ["<|im_end|>"]

    def filling(self, max_completion_length: int, tool_result_tokens: int = 8) -> LookupScript:
        """This script with the longest ``words_per_turn`` whose longest completion (``g = num_generations - 1``)
        fits in ``max_completion_length`` tokens, each tool result taking ``tool_result_tokens`` (:func:`lookup`'s 3
        words, their message's header and end, the next assistant header)."""
        g = self.num_generations - 1
        calls = g if self.max_calls is None else min(g, self.max_calls)
        fixed = calls * (6 + tool_result_tokens) + 1  # the calls, their results, the answer's end of turn
        return dataclasses.replace(self, words_per_turn=max(1, (max_completion_length - fixed) // (1 + g + calls)))


class _ScriptedToolCalls(LogitsProcessor):
    """Forces every token of one ``generate`` call: at its first step, ``script(conversation, row)`` gives each row's
    turn (the prompt's tokens are all there is then); at step ``i`` each row's ``i``-th token is the only one allowed,
    then the end-of-turn token. One instance serves one ``generate`` call (:func:`scripted_generation` makes them);
    after the first step it runs on the device, without reading the tokens back."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, script: Callable[[list[str], int], list[str]]):
        self.tokenizer, self.script = tokenizer, script
        self._forced: torch.Tensor | None = None
        self._start = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._forced is None:
            turns = [
                self.script(self.tokenizer.convert_ids_to_tokens(ids), row)
                for row, ids in enumerate(input_ids.tolist())
            ]
            end = self.tokenizer.eos_token
            width = max(map(len, turns))
            padded = [self.tokenizer.convert_tokens_to_ids(turn + [end] * (width - len(turn))) for turn in turns]
            self._forced, self._start = torch.tensor(padded, device=input_ids.device), input_ids.shape[1]
        step = min(input_ids.shape[1] - self._start, self._forced.shape[1] - 1)
        forced = torch.full_like(scores, -torch.inf)
        return forced.scatter_(1, self._forced[:, step : step + 1], 0.0)


@contextlib.contextmanager
def scripted_generation(
    tokenizer: PreTrainedTokenizerFast, script: Callable[[list[str], int], list[str]]
) -> Iterator[None]:
    """Within the block, every transformers ``generate`` call (TRL's, and hf_odc's decoding copies', whose classes
    inherit it) forces ``script``'s tokens (:class:`_ScriptedToolCalls`, after the call's own logits processors)."""
    generate = GenerationMixin.generate

    def scripted(self, *args: Any, logits_processor: LogitsProcessorList | None = None, **kwargs: Any) -> Any:
        processors = LogitsProcessorList([*(logits_processor or []), _ScriptedToolCalls(tokenizer, script)])
        return generate(self, *args, logits_processor=processors, **kwargs)

    GenerationMixin.generate = scripted
    try:
        yield
    finally:
        GenerationMixin.generate = generate

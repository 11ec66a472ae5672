"""GRPO with TRL's tool calling (``tools=``) and environments (``environment_factory=``) on scripted multi-turn
rollouts: one optimizer step per case, saving what to compare.

``python tests/support/_grpo_tools.py trl MODEL_DIR OUT CASE...`` trains stock ``trl.GRPOTrainer`` on one process with
the whole minibatch (8 rollouts); ``accelerate launch ... tests/support/_grpo_tools.py odc MODEL_DIR OUT CASE...``
trains ``ODCGRPOTrainer`` on each process with its share, generating with transformers in the case's ``odc_generation``
mode. Every token is forced by :class:`ScriptedToolCalls` (a logits processor added to every ``generate``), so both
sides decode the same multi-turn completions whatever the process count: the ``g``-th generation of a prompt calls the
tool ``g`` times (``<tool_call> lookup word w{g} </tool_call>``; at most once for a short prompt), then answers; with
``max_tool_calling_iterations = 2`` the third call of ``g = 3`` is not run; the rank holding the short prompt decodes
fewer turns. The tokenizer is the demo's word-level one with a tool role and a chat template that renders tool calls;
its ``parse_response`` reads the scripted calls back.

On the ODC side every microbatch's per-position log-probabilities keep their gradient: rank 0 saves, per case, the
gradient at each completion token with its loss mask (``probes``), from which the test checks that tool-result tokens
get none.
"""

from __future__ import annotations

import itertools
import os

import torch
from _parity import TRAINING, run_cases, trained_state
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast
from transformers.generation.utils import GenerationMixin

from hf_odc.demo.tokenizer import NUM_WORDS, ROLES, SPECIAL_TOKENS

MINIBATCH, GENERATIONS, MAX_ITERATIONS, SHORT_PROMPT = 8, 4, 2, 3
TOOL_WORDS = ["tool", "<tool_call>", "</tool_call>", "lookup", "word"]
CHAT_TEMPLATE = (
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
COMMON = TRAINING | dict(
    num_generations=GENERATIONS,
    max_completion_length=48,
    max_steps=1,
    max_tool_calling_iterations=MAX_ITERATIONS,
    loss_type="grpo",
)
# ODC side: the generation mode each case decodes in (the tools' case in every mode; the environment's in one).
CASES = {
    "tools-gathered": "gathered",
    "tools-sharded": "sharded",
    "tools-static": "static",
    "environment": "gathered",
}


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """The demo's word-level tokenizer (``hf_odc.demo.build_tokenizer``) with a tool role, tool-call words and a chat
    template that renders tool calls and tool messages; ``parse_response`` reads a completion's tool calls back."""
    words = SPECIAL_TOKENS + ROLES + TOOL_WORDS + [f"w{i}" for i in range(NUM_WORDS)]
    backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(words)}, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|pad|>", eos_token="<|im_end|>", unk_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    tokenizer.response_template = "scripted"  # TRL parses completions with parse_response when one is set
    tokenizer.parse_response = lambda ids, prefix=None, tools=None: parse_scripted(tokenizer, ids)
    return tokenizer


def parse_scripted(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> dict:
    """An assistant message: its ``<tool_call> NAME KEY VALUE ... </tool_call>`` calls, or its text."""
    tokens = tokenizer.convert_ids_to_tokens(list(ids))
    if "<tool_call>" not in tokens or "</tool_call>" not in tokens:
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    start, end = tokens.index("<tool_call>"), tokens.index("</tool_call>")
    name, *pairs = tokens[start + 1 : end]
    arguments = dict(zip(pairs[::2], pairs[1::2], strict=True))
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name,
            "arguments": arguments}}]}  # fmt: skip


def lookup(word: str) -> str:
    """Look a word up.

    Args:
        word: The word to look up.
    """
    g = int(word[1:])
    return " ".join(f"w{200 + 3 * g + j}" for j in range(3))


class LookupEnvironment:
    """An environment whose tool is :func:`lookup`, counting its calls (its reward)."""

    def reset(self, **kwargs) -> None:
        self.calls = 0

    def lookup(self, word: str) -> str:
        """Look a word up.

        Args:
            word: The word to look up.
        """
        self.calls += 1
        return lookup(word)


def environment_reward(environments, **kwargs) -> list[float]:
    return [float(environment.calls) for environment in environments]


def length_reward(completion_ids, **kwargs) -> list[float]:
    return [float(len(ids) % 7) for ids in completion_ids]


class ScriptedToolCalls(LogitsProcessor):
    """Forces every token: the ``g``-th generation of a prompt (``g`` its row modulo the group size in the first
    turn; read back from its first tool call's argument later) makes ``g`` tool calls (at most one for a short
    prompt, so that ranks run different numbers of turns), one per turn, then answers ``1 + g + turn`` words."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast):
        self.tokenizer, self.id = tokenizer, tokenizer.convert_tokens_to_ids

    def _turn(self, tokens: list[str], row: int) -> list[str]:
        turn = len(headers(tokens, "tool"))
        g = row % GENERATIONS if turn == 0 else int(tokens[tokens.index("<tool_call>") + 3][1:])
        user = headers(tokens, "user")[0]
        calls = g if tokens.index("<|im_end|>", user) - user - 2 > SHORT_PROMPT else min(g, 1)
        if turn < calls:
            return ["<tool_call>", "lookup", "word", f"w{g}", "</tool_call>", "<|im_end|>"]
        return [f"w{100 + 10 * g + turn + j}" for j in range(1 + g + turn)] + ["<|im_end|>"]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forced = torch.full_like(scores, -torch.inf)
        for row, ids in enumerate(input_ids.tolist()):
            tokens = self.tokenizer.convert_ids_to_tokens(ids)
            last = headers(tokens, "assistant")[-1]
            script, done = self._turn(tokens, row), len(tokens) - last - 2
            forced[row, self.id(script[done] if done < len(script) else "<|im_end|>")] = 0.0
        return forced


def headers(tokens: list[str], role: str) -> list[int]:
    """Where each ``<|im_start|> role`` header starts in ``tokens``."""
    return [i for i, pair in enumerate(itertools.pairwise(tokens)) if pair == ("<|im_start|>", role)]


def force_generation(tokenizer: PreTrainedTokenizerFast) -> None:
    """Every ``generate`` (TRL's, hf_odc's static copy's) runs :class:`ScriptedToolCalls`."""
    generate = getattr(GenerationMixin.generate, "unscripted", GenerationMixin.generate)

    def scripted(self, *args, **kwargs):
        return generate(self, *args, logits_processor=LogitsProcessorList([ScriptedToolCalls(tokenizer)]), **kwargs)

    scripted.unscripted = generate
    GenerationMixin.generate = scripted


def prompts(count: int) -> Dataset:
    """Prompts of 3 words and of 12, alternately (so that the ranks' rollouts differ in length and turns)."""
    words = [" ".join(f"w{i + j}" for j in range(SHORT_PROMPT + 9 * (i % 2))) for i in range(count)]
    return Dataset.from_list([{"prompt": [{"role": "user", "content": content}]} for content in words])


def probed(trainer_class):
    """``trainer_class`` keeping, for each trained microbatch, the gradient of the loss with respect to its per-position
    log-probabilities at each completion token, with the token's loss mask (``probes``)."""

    class Probed(trainer_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.probes = []

        def _microbatch_loss(self, model, microbatch, step):
            kept = []
            handle = model.register_forward_hook(lambda module, args, output: kept.append(output))
            try:
                loss = super()._microbatch_loss(model, microbatch, step)
            finally:
                handle.remove()
            log_probs = kept[0].log_probs
            log_probs.retain_grad()
            self.probes.append((log_probs, microbatch["loss"]["token_index"].cpu(), microbatch["loss"]["mask"].cpu()))
            return loss

    return Probed


def train_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    from trl import GRPOConfig, GRPOTrainer

    from hf_odc.trainer import ODCGRPOConfig, ODCGRPOTrainer

    tokenizer = build_tool_tokenizer()
    force_generation(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    if kind == "trl":
        args = GRPOConfig(output_dir, per_device_train_batch_size=MINIBATCH, **COMMON)
        trainer_class = GRPOTrainer
    else:
        args = ODCGRPOConfig(
            output_dir, per_device_train_batch_size=MINIBATCH // int(os.environ.get("WORLD_SIZE", "1")),
            max_tokens_per_microbatch=64, cost_model="tokens", odc_generation=CASES[name], **COMMON,
        )  # fmt: skip
        trainer_class = probed(ODCGRPOTrainer)
    tools = {"environment_factory": LookupEnvironment} if name == "environment" else {"tools": [lookup]}
    rewards = [length_reward] + ([environment_reward] if name == "environment" else [])
    trainer = trainer_class(
        model=model, reward_funcs=rewards, args=args, train_dataset=prompts(16), processing_class=tokenizer, **tools
    )
    trainer.train()
    probes = [
        (log_probs.grad[0][index].cpu(), index, mask) for log_probs, index, mask in getattr(trainer, "probes", [])
    ]
    result = trained_state(trainer)
    if result is not None:
        result["probes"] = probes
    return result


if __name__ == "__main__":
    run_cases(train_case)

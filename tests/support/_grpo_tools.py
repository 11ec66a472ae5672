"""GRPO with TRL's tool calling (``tools=``) and environments (``environment_factory=``) on scripted multi-turn
rollouts: one optimizer step per case, saving what to compare.

``python tests/support/_grpo_tools.py trl MODEL_DIR OUT CASE...`` trains stock ``trl.GRPOTrainer`` on one process with
the whole minibatch (8 rollouts); ``accelerate launch ... tests/support/_grpo_tools.py odc MODEL_DIR OUT CASE...``
trains ``ODCGRPOTrainer`` on each process with its share, generating with transformers in the case's
``odc_generation`` mode. Every token is forced by the demo's scripted policy (``hf_odc.demo.scripted_generation`` with
:data:`SCRIPT`, a ``LookupScript``), so both sides decode the same multi-turn completions whatever the process count:
the ``g``-th generation of a prompt calls the tool ``g`` times (``<tool_call> lookup word w{g} </tool_call>``; at
most once for a short prompt), then answers; with ``max_tool_calling_iterations = 2`` the third call of ``g = 3`` is
not run; the rank holding the short prompt decodes fewer turns. The tokenizer is the demo's tool tokenizer
(``hf_odc.demo.build_tool_tokenizer``: a tool role and a chat template that renders tool calls; its
``parse_response`` reads the scripted calls back).

On the ODC side every microbatch's per-position log-probabilities keep their gradient: rank 0 saves, per case, the
gradient at each completion token with its loss mask (``probes``), from which the test checks that tool-result tokens
get none.
"""

from __future__ import annotations

import os

from _parity import TRAINING, run_cases, trained_state
from datasets import Dataset
from transformers import AutoModelForCausalLM

from hf_odc.demo.tools import LookupScript, build_tool_tokenizer, lookup, scripted_generation

MINIBATCH, GENERATIONS, MAX_ITERATIONS, SHORT_PROMPT = 8, 4, 2, 3
SCRIPT = LookupScript(GENERATIONS, short_prompt=SHORT_PROMPT)
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


class LookupEnvironment:
    """An environment whose tool is :func:`~hf_odc.demo.lookup`, counting its calls (its reward)."""

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
    with scripted_generation(tokenizer, SCRIPT):
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

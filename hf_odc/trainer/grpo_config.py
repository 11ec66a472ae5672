"""``ODCGRPOConfig``: TRL's ``GRPOConfig`` plus the ODC fields every ODC trainer shares (:class:`_ODCConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from ._base_config import _document_odc_fields, _ODCConfig
from .generation import GENERATION_MODES


@_document_odc_fields
@dataclass
class ODCGRPOConfig(_ODCConfig, GRPOConfig):
    r"""
    Configuration class for [`ODCGRPOTrainer`]: every [`~trl.GRPOConfig`] field, plus the ODC fields below.

    Generation and scoring are TRL's. Then, once per generation batch, every rank gathers every rollout, the batch is
    cut into `steps_per_generation` minibatches of `per_device_train_batch_size * world_size` rollouts (a seeded
    permutation, the same on every rank), and each minibatch is planned with `hf_odc.packing` across the ranks: the
    ranks' shares may hold different numbers of rollouts and microbatches, each microbatch a padding-free packed row.
    `steps_per_generation` and `num_iterations` keep TRL's meaning, and so does `gradient_accumulation_steps`: an
    optimizer step takes `per_device_train_batch_size * gradient_accumulation_steps` rollouts per process, so the
    generation batch is cut into `steps_per_generation / gradient_accumulation_steps` minibatches (a whole number:
    `steps_per_generation` defaults to `gradient_accumulation_steps`), each planned as one ODC minibatch.

    Every loss normaliser is global, computed once per minibatch from the gathered rollouts, so that the update equals
    TRL's on one process holding the whole minibatch: with `B` the minibatch's rollouts and `N` its trained
    completion tokens, `grpo` and `sapo` divide each rollout's token mean by `B`; `bnpo` divides the token sum by `N`;
    `dr_grpo` by `B * max_completion_length`; `luspo` divides each rollout's token sum by `B`; `dapo`, `cispo` and
    `vespo` divide the token sum by the generation batch's trained tokens per optimizer step (TRL's definition); the
    entropy bonus is the mean entropy over the minibatch's trained tokens. With `gradient_accumulation_steps > 1` TRL
    computes `bnpo`'s token mean, the entropy bonus and its logged means per accumulation slice and averages the
    slices; hf_odc takes them over the whole minibatch (the same whatever the number of processes), which equals TRL's
    when the slices hold equal numbers of trained tokens. Every other loss equals TRL's with any accumulation.

    With `use_vllm=True`, TRL's vLLM generation runs (`vllm_mode="colocate"`: an engine on each rank, within
    `vllm_gpu_memory_utilization` of its device, sleep mode honoured; `"server"`: a vLLM server started as TRL
    documents, sent TRL's requests by rank 0) and only the weight sync is hf_odc's (`hf_odc.trainer.vllm_sync`): when
    TRL syncs, once per generation batch, the policy's full weights are assembled one FSDP group at a time by
    one-sided reads of the peers' shards, no collective, LoRA adapters merged, and loaded by every rank into its
    engine (colocate) or streamed by rank 0 to the server. TRL's importance-sampling correction of vLLM's rollouts
    (`vllm_importance_sampling_*`) is applied on the packed microbatches, and its `sampling/*` metrics cover the whole
    generation batch, as one process holding it logs them.

    Parameters:
    {odc_parameters}

        > Parameters of generation on the sharded policy

        odc_generation (`str`, *optional*):
            How each rank decodes its prompts with transformers (`hf_odc.trainer.generation`; unset with `use_vllm`,
            where vLLM decodes); never in lockstep but for `"lockstep"`. `"static"`: a plain copy of the policy in the
            compute dtype, kept for the whole run and refreshed in place once per generation batch (one-sided reads,
            no collective), decoded with a static KV cache and, on a GPU, a forward compiled once per run; costs the
            full weights in the compute dtype for the whole run, plus the cache. `"gathered"`: the policy's full
            weights assembled once per generation batch (one-sided reads) and freed before the update; costs them
            only while decoding. `"sharded"`: decoding inside a forward-only ODC minibatch, each forward reading its
            layers' shards from the peers (no copy; needs ODC). `"lockstep"`: TRL's own path (an all-gather per layer
            group per token, ranks in lockstep), the baseline. `None`: on a GPU, `"static"` when the copy takes at
            most a quarter of the device's free memory, else `"gathered"` when it takes at most half, else `"sharded"`
            (`"lockstep"` with plain FSDP2); on a CPU `"gathered"`. A rank that finishes decoding first waits for the
            others at the rollouts' gather, within `odc_timeout`: set it above the spread of the ranks' decoding
            times.

    > [!NOTE]
    > Not supported, refused at construction: `use_transformers_continuous_batching`, `top_entropy_quantile < 1` (its
    > threshold is a quantile over the whole minibatch's entropies under the current policy, which an ODC minibatch
    > has no collective to compute), PEFT with `beta > 0`, multimodal prompts, and with vLLM LoRA variants (DoRA),
    > `lora_bias` and LoRA on other than linear layers (their merge).
    > `model_init_kwargs` defaults `device_map` to `None`: every rank loads whole models and hf_odc shards them.
    """

    odc_generation: str | None = field(
        default=None,
        metadata={
            "help": "How each rank decodes its prompts: 'static' (a kept copy refreshed per generation batch, static "
            "KV cache, compiled on a GPU), 'gathered' (full weights assembled once per generation batch), 'sharded' "
            "(one-sided reads per forward, no copy) or 'lockstep' (TRL's, the baseline). Unset: on a GPU, static when "
            "the copy fits in a quarter of the free device memory, gathered in half, else sharded (lockstep with "
            "plain FSDP2); on a CPU gathered.",
            "choices": list(GENERATION_MODES),
        },
    )

    def __post_init__(self):
        if self.odc_generation is not None and self.odc_generation not in GENERATION_MODES:
            raise ValueError(f"odc_generation must be one of {GENERATION_MODES}, got {self.odc_generation!r}.")
        if self.use_vllm and self.odc_generation is not None:
            raise ValueError(
                "odc_generation chooses how each rank decodes with transformers; with use_vllm=True vLLM decodes. "
                "Leave odc_generation unset, or set use_vllm=False."
            )
        if self.use_transformers_continuous_batching:
            raise ValueError(
                "ODCGRPOTrainer generates with transformers' generate(), in lockstep across the sharded ranks; "
                "continuous batching runs each rank on its own. Set use_transformers_continuous_batching=False."
            )
        if self.top_entropy_quantile < 1.0:
            raise ValueError(
                "ODCGRPOTrainer does not support top_entropy_quantile < 1: the threshold is a quantile over the whole "
                "minibatch's entropies under the current policy, which ranks cannot gather inside an ODC minibatch. "
                "Set top_entropy_quantile=1.0."
            )
        super().__post_init__()
        if self.steps_per_generation % self.gradient_accumulation_steps:
            raise ValueError(
                f"ODCGRPOTrainer plans each optimizer step's rollouts as one minibatch of a generation batch, so "
                f"steps_per_generation ({self.steps_per_generation}) must be a multiple of gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}); leave steps_per_generation unset (it defaults to "
                "gradient_accumulation_steps) or set a multiple of it."
            )
        # Every rank loads the whole model (the policy given by name, the reference model) and hf_odc shards it:
        # TRL's default device_map="auto" would spread it over all of this host's GPUs instead. Unset, the trainer
        # sets them when it loads a model (ODCGRPOTrainer), so that TRL does not warn they are ignored when it does not.
        if self.model_init_kwargs is not None:
            self.model_init_kwargs = {"device_map": None, **self.model_init_kwargs}

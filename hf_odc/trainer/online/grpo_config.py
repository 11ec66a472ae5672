"""``ODCGRPOConfig``: TRL's ``GRPOConfig`` plus the ODC fields every ODC trainer shares (:class:`_ODCConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig

from ..core._base_config import _document_odc_fields
from ._rollout_config import _document_generation_fields, _ODCRolloutConfig


@_document_odc_fields
@_document_generation_fields
@dataclass
class ODCGRPOConfig(_ODCRolloutConfig, GRPOConfig):
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

    With `top_entropy_quantile < 1`, before each optimizer step a forward-only pass of the current policy over each
    rank's packed microbatches gives the entropy of every trained completion token; the ranks gather them once, and
    the policy loss trains only the tokens at or above their `1 - top_entropy_quantile` quantile. The entropy bonus and
    the adaptive controller's entropy are then means over those tokens, as in TRL. TRL takes the quantile over one
    accumulation slice's tokens on every process, hf_odc over the whole minibatch's: the same tokens when
    `gradient_accumulation_steps = 1`, and with accumulation a set that does not depend on the number of processes.
    The pass costs one more forward of the minibatch per step (`entropy_scoring_s`).

    With `beta > 0`, a PEFT policy (the base model with `peft_config`) takes as its reference the same sharded model
    with its adapter disabled, scored in a forward-only minibatch of packed rows like a separate reference model.

    With `tools` or `environment_factory`, TRL's multi-turn loop runs as it is (tool calls parsed, run, their results
    appended to the completion, at most `max_tool_calling_iterations` rounds), each turn decoded as `odc_generation`
    decodes: a multi-turn completion is packed and balanced whole, by its length with the tool results, whose tokens
    carry no loss (TRL's tool mask). The `"static"`, `"gathered"` and `"sharded"` modes decode each rank's turns
    alone, as many as its completions need, the weights assembled (or the ODC minibatch held) once per generation
    batch; `"lockstep"` (TRL's FSDP path, whose forwards gather collectively) needs every rank to decode as many
    turns.

    With `use_vllm=True`, TRL's vLLM generation runs (`vllm_mode="colocate"`: an engine on each rank, within
    `vllm_gpu_memory_utilization` of its device, sleep mode honoured; `"server"`: a vLLM server started as TRL
    documents, sent TRL's requests by rank 0), with hf_odc's weight sync (the `"vllm"` mode of
    `hf_odc.trainer.generation.modes`). TRL's importance-sampling correction of vLLM's rollouts
    (`vllm_importance_sampling_*`) is applied on the packed microbatches, and its `sampling/*` metrics cover the whole
    generation batch, as one process holding it logs them.

    Parameters:
    {odc_parameters}

    {generation_parameters}

    > [!NOTE]
    > Not supported, refused at construction: `use_transformers_continuous_batching` (generate with `odc_generation`
    > or vLLM), a PEFT model whose adapter TRL would copy as the reference (pass the base model with `peft_config`)
    > and prompt-learning PEFT, and with vLLM LoRA variants (DoRA), `lora_bias` and LoRA on other than linear layers
    > (their merge). A vision-language policy (Qwen2.5-VL, its processor as `processing_class`) decodes with
    > `odc_generation="gathered"` only, not vLLM.
    > `model_init_kwargs` defaults `device_map` to `None`: every rank loads whole models and hf_odc shards them.
    > With Accelerate's `sp_size` (a rollout longer than a microbatch split over a group of ranks): `loss_type="vespo"`,
    > `off_policy_mask_threshold` and vLLM's importance-sampling correction (whose weights need every token of a
    > rollout on one rank).
    """

    _splits_sequences = True

    def _check_sequence_parallel(self, sp_size: int) -> None:
        """The shared checks, then what a rollout split over ranks cannot train: the sequence-level weights TRL
        computes from every token of a rollout at once (VESPO's, the off-policy mask's, vLLM's correction's)."""
        super()._check_sequence_parallel(sp_size)
        refused = {
            "loss_type='vespo'": self.loss_type == "vespo",
            "off_policy_mask_threshold": self.off_policy_mask_threshold is not None,
            "use_vllm with vllm_importance_sampling_correction": self.use_vllm
            and self.vllm_importance_sampling_correction,
        }
        for setting, on in refused.items():
            if on:
                raise ValueError(
                    f"ODCGRPOConfig: {setting} weighs each rollout by all its tokens at once, which sp_size={sp_size} "
                    "splits over ranks; unset it or set sp_size to 1."
                )

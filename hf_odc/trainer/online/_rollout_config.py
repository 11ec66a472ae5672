"""The fields every online ODC trainer's config adds (GRPO, RLOO, distillation): how each rank decodes with
transformers, ``odc_generation``, and whether the next generation batch decodes while this one trains,
``max_rollout_staleness`` (:class:`_ODCRolloutConfig`, :func:`check_rollout_staleness`), their documentation
(:func:`_document_generation_fields`), and the checks that hold for every trainer that plans its generation batches as
ODC minibatches."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core._base_config import _ODCConfig, whole_model_kwargs
from ..generation.modes import GENERATION_MODES, check_generation_mode

_GENERATION_PARAMETERS = """
        > Parameters of generation on the sharded policy

        odc_generation (`str`, *optional*):
            How each rank decodes its prompts with transformers, never in lockstep but for `"lockstep"`: `"static"` (a
            kept copy of the policy, refreshed once per generation batch), `"gathered"` (the full weights held while
            decoding), `"sharded"` (one-sided reads per forward, no copy; needs ODC), `"tensor-parallel"` (each rank of
            the shard group holds a slice of a kept copy and they decode their prompts together, the activations
            all-reduced; Llama/Mistral/Qwen2/Qwen3 dense models with at least one attention head per rank, any key/value
            head count, no tools) or `"lockstep"` (TRL's path, the baseline); the modes, their costs and vLLM's
            (`use_vllm`, with which this stays unset) are described in `hf_odc.trainer.generation.modes`. `None`: on a
            GPU, by measured decoding speed, `"static"` when the copy takes at most a quarter of the device's free
            memory, else `"tensor-parallel"` when the largest rank's slice does (a model it slices, no tools), else
            `"gathered"` when the copy takes at most half, else `"lockstep"` (`"sharded"` with tools under ODC, where
            each rank decodes its own number of turns); on a CPU `"gathered"`. A rank that finishes decoding first waits
            for the others at the rollouts' gather,
            within `odc_timeout`: set it above the spread of the ranks' decoding times.
        odc_decoding_loop (`bool`, *optional*, defaults to `True`):
            With `odc_generation="static"` or `"tensor-parallel"`: decode with hf_odc's own loop
            (`hf_odc.trainer.generation._static_decoding`: on a GPU each step replayed from a CUDA graph, the host
            asking for the end every 16 steps instead of every token) wherever it decodes what transformers' `generate`
            would (greedy or sampling with temperature, top-k, top-p, min-p and repetition penalty; anything else still
            goes to `generate`), or always with `generate` (`False`). The loop is the default of both modes: on
            `"static"` its forward is compiled once for every cache width and by decoder layer, so its first batch
            (compile included) takes less time than `generate`'s, and every later step less too;
            `"tensor-parallel"`'s forward holds collectives and is not compiled, so only the loop's graphs take the
            host out of each step.
        max_rollout_staleness (`int`, *optional*, defaults to `0`):
            How many generation batches of updates the policy that decodes a generation batch may lag behind the one
            it trains: `0`, synchronous (each batch decoded by the weights it then trains); `1`, off-policy by one
            batch: once a generation batch's rollouts are in, each rank decodes the next batch's prompts (read ahead
            from the data loader, the same prompts in the same order) on the `"static"` copy still holding the weights
            that decoded this one, in a background thread (on a GPU its own CUDA stream), while this batch's scoring
            and updates run; the next batch takes those rollouts, then refreshes the copy and starts the one after.
            The first batch of the run, and the first of each epoch (whose prompts cannot be read ahead), decode
            synchronously. The importance ratio of an overlapped batch is taken against the policy that decoded its
            tokens (their log-probabilities under the copy, scored in the same thread; also the off-policy mask's
            sampling log-probabilities), not against the current weights, which TRL's old-policy pass would score: so
            the clip bounds the step from the behaviour policy, as in PPO. Needs `odc_generation="static"` (the only
            mode that decodes alone on weights the update does not touch), no `tools`, environments or `rollout_func`,
            and not vLLM. The thread seeds the process's random generator with `seed` plus the batch's index before it
            samples: a run is reproducible where the update draws no random numbers meanwhile. Under activation
            checkpointing the checkpoints then leave the random generators alone (`preserve_rng_state=False`: their
            recomputation would rewind the generators the thread samples from), and a policy with dropout is refused.
"""


def check_rollout_staleness(staleness: int, mode: str | None, use_vllm: bool) -> None:
    """Raise ``ValueError``, naming what to set, where ``max_rollout_staleness`` is not 0 or 1, or is 1 with a
    generation mode that cannot decode in the background while the update runs."""
    if staleness not in (0, 1):
        raise ValueError(
            f"max_rollout_staleness must be 0 (synchronous) or 1 (the next generation batch decoded while this one "
            f"trains), got {staleness!r}."
        )
    if staleness == 0:
        return
    if use_vllm:
        raise ValueError(
            "max_rollout_staleness=1 decodes the next generation batch on this rank's 'static' copy in a background "
            "thread, not with vLLM; set use_vllm=False and odc_generation='static', or max_rollout_staleness=0."
        )
    why = {
        None: "is unset (a mode chosen by device memory)",
        "lockstep": "decodes in lockstep with the other ranks, one collective per token",
        "tensor-parallel": "decodes with collectives that would interleave with the update's",
        "gathered": "decodes on the policy's own weights, which the update changes",
        "sharded": "decodes inside an ODC minibatch of the policy, which the update runs too",
    }
    if mode != "static":
        raise ValueError(
            f"max_rollout_staleness=1 decodes in a background thread while the update runs; odc_generation={mode!r} "
            f"{why.get(mode, 'cannot')}. Set odc_generation='static', or max_rollout_staleness=0."
        )


def _document_generation_fields(config_class: type) -> type:
    """Put ``odc_generation``'s documentation where ``config_class``'s docstring says ``{generation_parameters}``."""
    config_class.__doc__ = config_class.__doc__.replace(
        "    {generation_parameters}", _GENERATION_PARAMETERS.strip("\n")
    )
    return config_class


@dataclass
class _ODCRolloutConfig(_ODCConfig):
    """The ODC fields plus ``odc_generation``, for a config whose TRL class generates (``use_vllm``,
    ``model_init_kwargs``; ``steps_per_generation`` and continuous batching where it has them). Refuses what no ODC
    rollout trainer runs, naming what to set."""

    odc_generation: str | None = field(
        default=None,
        metadata={
            "help": "How each rank decodes its prompts (hf_odc.trainer.generation.modes): 'static', 'gathered', "
            "'sharded', 'tensor-parallel' or 'lockstep'. Unset: on a GPU, static when the copy fits in a quarter of "
            "the free device memory, tensor-parallel when its slice does, gathered when the copy fits in half, else "
            "lockstep (sharded with tools under ODC); on a CPU gathered.",
            "choices": list(GENERATION_MODES),
        },
    )
    odc_decoding_loop: bool = field(
        default=True,
        metadata={
            "help": "With odc_generation='static' or 'tensor-parallel': decode with hf_odc's own loop (CUDA graphs, "
            "no host sync per token) where it decodes what generate would; False: always transformers' generate."
        },
    )

    max_rollout_staleness: int = field(
        default=0,
        metadata={
            "help": "0: synchronous. 1: each rank decodes the next generation batch on the 'static' copy in a "
            "background thread while this one trains (off-policy by one batch; the ratio is taken against the "
            "policy that decoded it). Needs odc_generation='static'.",
            "choices": [0, 1],
        },
    )

    def __post_init__(self):
        trainer = type(self).__name__.removesuffix("Config") + "Trainer"
        check_generation_mode(self.odc_generation, self.use_vllm)
        check_rollout_staleness(self.max_rollout_staleness, self.odc_generation, self.use_vllm)
        if getattr(self, "use_transformers_continuous_batching", False):
            raise ValueError(
                f"{trainer} generates with transformers' generate(), in lockstep across the sharded ranks; "
                "continuous batching runs each rank on its own. Set use_transformers_continuous_batching=False."
            )
        super().__post_init__()
        if getattr(self, "steps_per_generation", 0) % self.gradient_accumulation_steps:
            raise ValueError(
                f"{trainer} plans each optimizer step's rollouts as one minibatch of a generation batch, so "
                f"steps_per_generation ({self.steps_per_generation}) must be a multiple of gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}); leave steps_per_generation unset (it defaults to "
                "gradient_accumulation_steps) or set a multiple of it."
            )
        if self.max_rollout_staleness and self.checkpoints_activations:
            self._checkpoint_without_rng_state()
        # The policy given by name and the reference model are loaded whole on every rank. Unset, the trainer sets them
        # when it loads a model, so that TRL does not warn they are ignored when it does not.
        if self.model_init_kwargs is not None:
            self.model_init_kwargs = whole_model_kwargs(self.model_init_kwargs)

    def _checkpoint_without_rng_state(self) -> None:
        """Checkpoints that leave the random generators alone (``preserve_rng_state=False``): a recomputation restores
        the state its forward saw, then the one before it, while the thread decoding ahead samples from the same
        generators, which would draw numbers it drew before. Nothing in the recomputation needs the state (the trainer
        refuses a policy with dropout: :meth:`~hf_odc.trainer.online._rollout_trainer._ODCRolloutTrainer.__init__`)."""
        for name in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
            if not hasattr(self, name):
                continue
            kwargs = dict(getattr(self, name) or {"use_reentrant": False})
            if kwargs.get("preserve_rng_state"):
                raise ValueError(
                    f"max_rollout_staleness=1 samples in a background thread from the random generators that "
                    f"{name}' preserve_rng_state=True rewinds at every recomputation; unset it, or set "
                    "max_rollout_staleness=0."
                )
            setattr(self, name, {**kwargs, "preserve_rng_state": False})

    def max_tokens_for(self, longest_sample: int) -> int:
        """Tokens one packed microbatch of rollouts may hold: with neither ``max_tokens_per_microbatch`` nor
        ``packing_ratio`` set, ``per_device_train_batch_size`` longest rollouts of the minibatch, what one of stock
        TRL's padded forward passes holds; rollouts are short beside an SFT sample, and one rollout per microbatch
        would spend the update on parameter reads. Unless ``max_tokens_per_microbatch`` is set, at least
        ``min_tokens_per_microbatch``, so that the device, not the host, sets the microbatch's pace."""
        if self.max_tokens_per_microbatch is None and self.packing_ratio is None:
            tokens = longest_sample * self.per_device_train_batch_size
        else:
            tokens = super().max_tokens_for(longest_sample)
        return self.at_least_min_tokens(tokens)

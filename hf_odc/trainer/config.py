"""``ODCSFTConfig``: TRL's ``SFTConfig`` plus the ODC fields every ODC trainer shares (:class:`_ODCConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import SFTConfig

from ._base import _ODCConfig


@dataclass
class ODCSFTConfig(_ODCConfig, SFTConfig):
    r"""
    Configuration class for [`ODCSFTTrainer`]: every [`~trl.SFTConfig`] field, plus the ODC fields below.

    Each optimizer step takes `per_device_train_batch_size * world_size` samples (the *global minibatch*, the same on
    every rank), plans it with `hf_odc.packing`, and runs each rank's share as padding-free packed microbatches.
    `gradient_accumulation_steps` must stay 1: grow `per_device_train_batch_size` instead, the planner cuts the
    minibatch into as many microbatches as `max_tokens_per_microbatch` requires. `packing` and `padding_free` stay
    off: the planner packs.

    Parameters:
        > Parameters of On-Demand Communication and the minibatch plan

        odc (`bool`, *optional*):
            Run each rank's microbatches with On-Demand Communication: ranks meet once per minibatch, so they may run
            different numbers of microbatches. `False` runs plain FSDP2 (collectives in every layer), which needs the
            same microbatch count on every rank: the fair baseline is `balance="lb-micro"`. `None` reads
            `HF_ODC_ENABLED` (default `True`).
        odc_timeout (`float`, *optional*):
            Seconds the minibatch barrier waits for a live peer before raising `hf_odc.PeerFailureError`. `None`
            reads `HF_ODC_TIMEOUT`, else `hf_odc.kernels.DEFAULT_TIMEOUT_S`.
        odc_transport (`str`, *optional*):
            The transport ODC reads and pushes through, a name of `hf_odc.kernels.TRANSPORTS` (`"cpu-shm"`,
            `"cuda-symm-mem"`). `None` reads `HF_ODC_TRANSPORT`, else the one for the model's device.
        balance (`str`, *optional*):
            How the global minibatch is split (a name of `hf_odc.packing.PLANNERS`): `"lb-mini"` balances each rank's
            total cost, ranks may run different numbers of microbatches (needs `odc=True`); `"lb-micro"` gives every
            rank the same number of microbatches, each microbatch step balanced across ranks; `"local-sort"` deals
            samples round-robin, one per microbatch (the unbalanced baseline). `None`: `"lb-mini"` with ODC,
            `"lb-micro"` without.
        max_tokens_per_microbatch (`int`, *optional*):
            Token capacity of one packed microbatch. Mutually exclusive with `packing_ratio`.
        packing_ratio (`float`, *optional*):
            Token capacity of one packed microbatch as a multiple of the longest sample (`max_length`, so `1.0` fits
            exactly one longest sample). Used when `max_tokens_per_microbatch` is not set; defaults to `1.0`.
        cost_model (`str`, *optional*, defaults to `"attention"`):
            Per-sample cost the planner balances (a name of `hf_odc.packing.COSTS`): `"attention"` (FLOPs of the
            trained model's shape, linear plus quadratic in the length; see `hf_odc.packing.AttentionCost`) or
            `"tokens"` (sequence length).
        packed_attention (`bool`, *optional*, defaults to `True`):
            Switch a model whose attention implementation is `"sdpa"` or `"eager"` (transformers' default) to
            hf_odc's `"odc_packed"` (`hf_odc.trainer.attention`): each packed sample is attended on its own, so a
            microbatch costs the sum of its samples instead of the square of its length, with no `T x T` mask.
            `False` keeps the model's implementation (with a warning for `sdpa`/`eager` on a GPU). Flash and flex
            attention are always kept.

    > [!NOTE]
    > Defaults that differ from TRL's configs: `bf16` defaults to `True` only when CUDA is available (CPU runs are
    > fp32, exact enough to compare with a single-process run), and `use_cpu` defaults to `True` when no CUDA device
    > exists: `accelerate launch` starts CPU processes through torchrun without telling them to use the CPU, and
    > without it every process would silently train alone.
    """

    def __post_init__(self):
        if self.packing or self.padding_free:
            raise ValueError(
                "ODCSFTTrainer packs each microbatch itself (padding-free, from the plan); leave packing and "
                "padding_free off."
            )
        super().__post_init__()

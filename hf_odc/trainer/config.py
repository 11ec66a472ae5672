"""``ODCSFTConfig``: TRL's ``SFTConfig`` plus how each optimizer step's minibatch is balanced, packed and run."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from trl import SFTConfig

from ..accelerate_plugin import ODCPlugin

BALANCES = ("lb-mini", "lb-micro", "local-sort")
COST_MODELS = ("tokens", "attention")


@dataclass
class ODCSFTConfig(SFTConfig):
    r"""
    Configuration class for [`ODCSFTTrainer`]: every [`~trl.SFTConfig`] field, plus the ones below.

    Each optimizer step takes `per_device_train_batch_size * world_size` samples (the *global minibatch*, the same on
    every rank), plans it with `hf_odc.packing`, and runs each rank's share as padding-free packed microbatches.
    `gradient_accumulation_steps` must stay 1: grow `per_device_train_batch_size` instead, the planner cuts the
    minibatch into as many microbatches as `max_tokens_per_microbatch` requires.

    Parameters:
        > Parameters that control On-Demand Communication

        odc (`bool`, *optional*):
            Run each rank's microbatches with On-Demand Communication: ranks meet once per minibatch, so they may run
            different numbers of microbatches. `False` runs plain FSDP2 (collectives in every layer), which needs the
            same microbatch count on every rank: the fair baseline is `balance="lb-micro"`. `None` reads
            `ODC_ENABLED` (default `True`).
        odc_timeout (`float`, *optional*):
            Seconds the minibatch barrier waits for a live peer before raising `hf_odc.PeerFailureError`. `None`
            reads `ODC_TIMEOUT`, else the engine's default (`HF_ODC_TIMEOUT` or 600).

        > Parameters that control the minibatch plan

        balance (`str`, *optional*):
            How the global minibatch is split: `"lb-mini"` balances each rank's total cost, ranks may run different
            numbers of microbatches (needs `odc=True`); `"lb-micro"` gives every rank the same number of
            microbatches, each microbatch step balanced across ranks; `"local-sort"` deals samples round-robin, one
            per microbatch (the unbalanced baseline). `None`: `"lb-mini"` with ODC, `"lb-micro"` without.
        max_tokens_per_microbatch (`int`, *optional*):
            Token capacity of one packed microbatch. Mutually exclusive with `packing_ratio`.
        packing_ratio (`float`, *optional*):
            Token capacity of one packed microbatch as a multiple of `max_length` (so `1.0` fits exactly one longest
            sample). Used when `max_tokens_per_microbatch` is not set; defaults to `1.0`.
        cost_model (`str`, *optional*, defaults to `"attention"`):
            Per-sample cost the planner balances: `"attention"` (FLOPs of the trained model's shape, linear plus
            quadratic in the length; see `hf_odc.packing.AttentionCost`) or `"tokens"` (sequence length). On 2xH200
            with 16K-token samples, balancing attention FLOPs cut the gap between the ranks' work from 12% to 8%
            (benchmarks/RESULTS.md).
        packed_attention (`bool`, *optional*, defaults to `True`):
            Switch a model whose attention implementation is `"sdpa"` or `"eager"` (transformers' default) to
            hf_odc's `"odc_packed"` (`hf_odc.trainer.attention`): each packed sample is attended on its own, so a
            microbatch costs the sum of its samples instead of the square of its length, with no `T x T` mask.
            `False` keeps the model's implementation (with a warning for `sdpa`/`eager` on a GPU). Flash and flex
            attention are always kept.

    > [!NOTE]
    > Defaults that differ from [`~trl.SFTConfig`]: `bf16` defaults to `True` only when CUDA is available (CPU runs
    > are fp32, exact enough to compare with a single-process run), and `use_cpu` defaults to `True` when no CUDA
    > device exists: `accelerate launch` starts CPU processes through torchrun without telling them to use the CPU,
    > and without it every process would silently train alone.
    """

    odc: bool | None = field(
        default=None,
        metadata={
            "help": "Run each rank's microbatches with On-Demand Communication (ranks meet once per minibatch). False "
            "runs plain FSDP2 (the baseline). Unset: ODC_ENABLED, default true."
        },
    )
    odc_timeout: float | None = field(
        default=None,
        metadata={"help": "Seconds the minibatch barrier waits for a live peer. Unset: ODC_TIMEOUT, default 600."},
    )
    balance: str | None = field(
        default=None,
        metadata={
            "help": "Minibatch plan: 'lb-mini' (balance each rank's total, needs odc), 'lb-micro' (equal microbatch "
            "counts, each step balanced) or 'local-sort' (round-robin, one sample per microbatch). Unset: lb-mini "
            "with ODC, lb-micro without.",
            "choices": list(BALANCES),
        },
    )
    max_tokens_per_microbatch: int | None = field(
        default=None,
        metadata={"help": "Token capacity of one packed microbatch. Exclusive with packing_ratio."},
    )
    packing_ratio: float | None = field(
        default=None,
        metadata={"help": "Microbatch capacity as a multiple of max_length (default 1.0 when no token cap is set)."},
    )
    cost_model: str = field(
        default="attention",
        metadata={
            "help": "Per-sample cost to balance: 'attention' (FLOPs of the model's shape) or 'tokens'.",
            "choices": list(COST_MODELS),
        },
    )

    packed_attention: bool = field(
        default=True,
        metadata={
            "help": "Switch sdpa/eager models to hf_odc's 'odc_packed' attention (each packed sample attended on its "
            "own, no T x T mask). False keeps the model's implementation."
        },
    )

    def __post_init__(self):
        if not torch.cuda.is_available():
            self.use_cpu = True
            if self.bf16 is None:
                self.bf16 = False
        plugin = ODCPlugin(enabled=self.odc, timeout=self.odc_timeout)
        self.odc, self.odc_timeout = plugin.enabled, plugin.timeout
        if self.balance is None:
            self.balance = "lb-mini" if self.odc else "lb-micro"
        if self.balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {self.balance!r}.")
        if self.balance == "lb-mini" and not self.odc:
            raise ValueError(
                "balance='lb-mini' gives ranks different numbers of microbatches, which plain FSDP2 (odc=False) "
                "cannot run: its per-layer collectives would deadlock. Use balance='lb-micro' for the baseline."
            )
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"cost_model must be one of {COST_MODELS}, got {self.cost_model!r}.")
        if self.max_tokens_per_microbatch is not None and self.packing_ratio is not None:
            raise ValueError("Set max_tokens_per_microbatch or packing_ratio, not both.")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {self.max_tokens_per_microbatch}.")
        if self.packing_ratio is not None and not self.packing_ratio > 0:
            raise ValueError(f"packing_ratio must be > 0, got {self.packing_ratio}.")
        if self.max_tokens_per_microbatch is None and self.max_length is None:
            raise ValueError("Set max_tokens_per_microbatch when max_length is None (there is nothing to scale).")
        if self.gradient_accumulation_steps != 1:
            raise ValueError(
                "ODCSFTTrainer runs one global minibatch per optimizer step, cut into microbatches by the planner; "
                "set gradient_accumulation_steps=1 and grow per_device_train_batch_size instead."
            )
        if self.packing or self.padding_free:
            raise ValueError(
                "ODCSFTTrainer packs each microbatch itself (padding-free, from the plan); leave packing and "
                "padding_free off."
            )
        super().__post_init__()

    @property
    def microbatch_token_cap(self) -> int:
        """Tokens one packed microbatch may hold."""
        if self.max_tokens_per_microbatch is not None:
            return self.max_tokens_per_microbatch
        return max(1, int(self.max_length * (self.packing_ratio or 1.0)))

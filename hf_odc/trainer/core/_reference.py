"""A trainer's frozen reference: sharded once (:func:`shard_reference`), which model it is (:func:`reference_of`), and
the PEFT setups whose reference the packed path cannot reproduce (:func:`check_peft_reference`).

The preference trainers (``ODCDPOTrainer``, ``ODCKTOTrainer``) and the online trainers with a KL term
(``ODCGRPOTrainer``, ``ODCRLOOTrainer``) pick their reference as TRL's do: ``ref_model``; else, under PEFT, the policy
with its adapter disabled; else a copy of the policy loaded by name, or, with ``precompute_ref_log_probs``, the policy
itself before training.
"""

from __future__ import annotations

import contextlib
from typing import Any

from accelerate.utils import is_peft_model
from torch import nn

from ...accelerate_plugin import ODCRuntime

__all__ = ["check_peft_reference", "reference_of", "refuse_prompt_learning", "shard_reference"]


def shard_reference(trainer: Any) -> ODCRuntime | None:
    """Shard ``trainer.ref_model``, if it has one, frozen, with ODC of its own
    (:meth:`~hf_odc.trainer.core._base_trainer._ODCTrainer._shard_frozen`), after the policy's ``_setup_odc``; returns
    its runtime (``None`` without one), which the trainer keeps as ``_ref_odc`` for :func:`reference_of`."""
    if getattr(trainer, "ref_model", None) is None:
        return None
    trainer.ref_model, runtime = trainer._shard_frozen(trainer.ref_model)
    return runtime


def reference_of(trainer: Any) -> tuple[nn.Module, Any, contextlib.AbstractContextManager]:
    """``trainer``'s reference model, its ODC runtime, and the context to run it in: ``trainer.ref_model`` (sharded,
    with its runtime ``trainer._ref_odc``); else the policy with its PEFT adapter disabled; else (precomputing, before
    training) the policy itself."""
    if trainer.ref_model is not None:
        return trainer.ref_model, trainer._ref_odc, contextlib.nullcontext()
    policy = trainer.accelerator.unwrap_model(trainer.model)
    return trainer.model, trainer.odc, policy.disable_adapter() if is_peft_model(policy) else contextlib.nullcontext()


def check_peft_reference(policy: nn.Module, trainer: str, alternative: str = ", or a ref_model") -> None:
    """Refuse the PEFT setups whose reference the packed path cannot reproduce (``trainer`` names the trainer;
    ``alternative`` ends the message for the re-trained adapter, empty for a trainer that takes no ``ref_model``)."""
    if not is_peft_model(policy):
        return
    if "ref" in policy.peft_config:
        raise NotImplementedError(
            f"{trainer} got a PEFT model with an adapter to re-train: TRL would keep a copy of the adapter as "
            "the reference and switch adapters between passes, which changes the trainable parameters ODC laid out. "
            f"Pass the base model with peft_config (the reference is then the base model, adapter disabled)"
            f"{alternative}."
        )
    refuse_prompt_learning(policy, trainer)


def refuse_prompt_learning(policy: Any, trainer: str) -> None:
    """Refuse a PEFT ``policy`` with prompt learning (prefix, prompt or P-tuning): its virtual tokens belong to a row,
    and a packed row holds several items (pairs, rollouts)."""
    config = getattr(policy, "active_peft_config", None)
    if config is not None and config.is_prompt_learning:
        raise NotImplementedError(
            f"{trainer} does not support prompt-learning PEFT (prefix, prompt or P-tuning): its virtual tokens "
            "belong to a row, and a packed row holds several pairs. Use LoRA (or another adapter method)."
        )

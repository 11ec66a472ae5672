"""Every private name of torch, transformers, TRL, Accelerate and vLLM that hf_odc overrides, calls, reads or sets,
in one place.

hf_odc's trainers extend TRL's by their hooks, several of them private (``_prepare_inputs``, ``_save_checkpoint``,
``GRPOTrainer._generate``...), and read state TRL's ``__init__`` creates (``_metrics``, ``_buffered_inputs``...). A
release that renames one would otherwise surface as an ``AttributeError`` deep in a step, or worse as an override that
silently no longer runs. So each name is listed here, the classes' are checked when :mod:`hf_odc.trainer` is imported
(:func:`check_classes`), a trainer's instance state when it is built (:func:`check_trainer`), and a failure names the
library, its version and what is missing.

Every other private name is read by a function of this module, which checks it first:

* torch: the default store (``distributed_c10d._get_default_store``), the job's process groups and their timeouts
  (``distributed_c10d._world``, ``_set_pg_timeout`` before torch 2.14), CUDA symmetric memory
  (``torch.distributed._symmetric_memory``), the attention operators (``aten._scaled_dot_product_*``,
  ``torch_attn::_varlen_attn``);
* transformers: ``generate``'s own preparation (``GenerationMixin._prepare_generation_config``,
  ``_prepare_special_tokens``, ``_get_logits_processor``, ``_get_stopping_criteria``), a config's
  ``_attn_implementation``, a model class's ``_from_config``, ``_no_split_modules`` and ``_can_record_outputs``, the
  ``_is_fsdp_managed_module`` mark, the Trainer's ``is_distributed_loading_by_transformers``,
  ``transformers.trainer_utils``'s logger;
* TRL: ``DataCollatorForLanguageModeling`` (not exported by ``trl``), the GRPO, RLOO and distillation trainers'
  loggers, ``VLLMGeneration``'s ``_llm_weights_sleeping``, ``SFTTrainer``'s, ``DPOTrainer``'s and ``RewardTrainer``'s
  ``_prepare_dataset`` and the state it reads (``_tokenizer``, ``chat_template``, ``completion_only_loss``).

FSDP2's private state (its parameter groups and their layout) is the engine's alone, read and checked in
:mod:`hf_odc.engine._fsdp_internals`; the torch version floor, and the check both use for torch, are in
:mod:`hf_odc._torch_support`. tests/unit/test_compat.py fails when a private name of these libraries is read anywhere
else.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
from collections.abc import Iterable, Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

__all__ = [
    "CLASS_NAMES",
    "INSTANCE_NAMES",
    "UnsupportedLibraryError",
    "attention_operators",
    "attn_implementation",
    "cache_argument",
    "check_classes",
    "check_trainer",
    "decoding_alone",
    "default_store",
    "generating_on",
    "generation_setup",
    "library_logger",
    "mark_distributed_loading",
    "mark_fsdp_managed",
    "mark_vllm_weights_awake",
    "model_from_config",
    "no_split_modules",
    "padding_free_collator",
    "process_groups",
    "router_modules",
    "set_attn_implementation",
    "set_group_timeout",
    "symmetric_memory",
    "tokenized_prompts",
]


class UnsupportedLibraryError(RuntimeError):
    """An installed torch, TRL, transformers, Accelerate or vLLM lacks a private name hf_odc relies on."""


CLASS_NAMES: dict[str, tuple[str, ...]] = {
    # The Trainer hooks the ODC trainers override (checkpoints, bounded collectives) or call.
    "transformers:Trainer": (
        "_prepare_inputs",
        "_save",
        "_get_output_dir",
        "_save_checkpoint",
        "_load_from_checkpoint",
        "_load_optimizer_and_scheduler",
        "_save_optimizer_and_scheduler",
        "_clip_grad_norm",
        "_maybe_log_save_evaluate",
    ),
    # GRPO's generation, scoring and loss pieces ODCGRPOTrainer wraps or reuses.
    "trl:GRPOTrainer": (
        "_generate",
        "_tokenize_prompts",
        "_generate_single_turn",
        "_tool_call_loop",
        "_generate_and_score_completions",
        "_get_per_token_logps_and_entropies",
        "_prepare_inputs",
        "get_off_policy_mask",
        "get_gamma_weights",
    ),
    # RLOO's generation and scoring pieces ODCRLOOTrainer wraps (its rewards kept for the KL-penalised advantages).
    "trl:RLOOTrainer": (
        "_generate",
        "_tokenize_prompts",
        "_generate_single_turn",
        "_generate_and_score_completions",
        "_get_per_token_logps_and_entropies",
        "_calculate_rewards",
        "_prepare_inputs",
    ),
    # Distillation's generation pieces ODCDistillationTrainer wraps.
    "trl:DistillationTrainer": (
        "_generate",
        "_tokenize_prompts",
        "_generate_single_turn",
        "_generate_and_score_completions",
        "_prepare_inputs",
    ),
    # DPO's and KTO's precomputation of the reference log-probabilities, which the ODC trainers run themselves once
    # they have sharded.
    "trl:DPOTrainer": ("_precompute_ref_logps",),
    "trl:KTOTrainer": ("_precompute_ref_logps",),
}
"""``"module:Class"`` -> the attributes hf_odc needs on that class. (``Trainer._defer_fsdp_gradient_reduction`` is
overridden too, but only transformers >= 5.23 has and calls it: nothing to check.)"""

INSTANCE_NAMES: dict[str, tuple[str, ...]] = {
    "trl:SFTTrainer": ("_metrics", "_total_train_tokens", "_tokenizer", "maybe_activation_offload_context"),
    "trl:DPOTrainer": ("_metrics", "_total_train_tokens", "maybe_activation_offload_context"),
    "trl:RewardTrainer": ("_metrics", "_total_train_tokens", "maybe_activation_offload_context"),
    "trl:KTOTrainer": ("_metrics", "_total_train_tokens", "maybe_activation_offload_context", "aux_loss_enabled"),
    "trl:GRPOTrainer": ("_metrics", "_step", "_buffered_inputs", "_entropy_bonus_enabled", "_last_world_entropy"),
    "trl:RLOOTrainer": ("_metrics", "_logs", "_step", "_buffered_inputs", "reward_weights"),
    "trl:DistillationTrainer": ("_metrics", "_step", "_buffered_inputs", "teacher_model", "beta", "temperature"),
}
"""``"module:Class"`` -> the attributes an instance of it (its ``__init__``) must have for hf_odc to read or set."""


def _resolve(spec: str) -> type:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _library_version(spec: str) -> str:
    library = spec.split(":")[0].split(".")[0]
    return f"{library} {getattr(importlib.import_module(library), '__version__', '?')}"


def _require(obj: Any, names: Iterable[str], spec: str, what: str) -> None:
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        raise UnsupportedLibraryError(
            f"hf_odc relies on {spec.replace(':', '.')}{what}'s {', '.join(missing)}, which {_library_version(spec)} "
            "does not have: this release changed a private name hf_odc reads. Install the version pyproject.toml "
            "was checked with (see its dependency comments), or update hf_odc/_compat.py and the code that uses it."
        )


def _module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise UnsupportedLibraryError(
            f"hf_odc relies on the module {name}, which {_library_version(name)} does not have ({e}). Update "
            "hf_odc/_compat.py."
        ) from e


def _checked(spec: str, *names: str) -> Any:
    """The class ``"module:Class"`` or the module ``spec``, once it has every one of ``names``."""
    obj = _resolve(spec) if ":" in spec else _module(spec)
    _require(obj, names, spec, "")
    return obj


def check_classes(specs: dict[str, tuple[str, ...]] | None = None) -> None:
    """Raise :class:`UnsupportedLibraryError` naming the first class of ``specs`` (default :data:`CLASS_NAMES`) that
    lacks one of its names."""
    for spec, names in (CLASS_NAMES if specs is None else specs).items():
        _require(_resolve(spec), names, spec, "")


def check_trainer(trainer: Any) -> None:
    """Raise :class:`UnsupportedLibraryError` if ``trainer`` lacks state that :data:`INSTANCE_NAMES` lists for one
    of its TRL base classes (call it once its TRL ``__init__`` has run)."""
    for spec, names in INSTANCE_NAMES.items():
        if isinstance(trainer, _resolve(spec)):
            _require(trainer, names, spec, " instances")


def mark_fsdp_managed(model: Any) -> None:
    """Tell transformers that ``model`` is sharded by FSDP (its private ``_is_fsdp_managed_module`` flag), and check
    that transformers reads the flag, as generation depends on it."""
    from transformers.distributed.fsdp import is_fsdp_managed_module

    model._is_fsdp_managed_module = True
    if not is_fsdp_managed_module(model):
        raise UnsupportedLibraryError(
            f"{_library_version('transformers:x')} no longer reads _is_fsdp_managed_module: hf_odc cannot mark a model "
            "it sharded as FSDP-managed. Update hf_odc/_compat.py."
        )


@contextlib.contextmanager
def decoding_alone(model: Any) -> Iterator[None]:
    """Inside the block transformers' ``generate`` decodes ``model`` on this rank alone, without lockstep: it keeps
    ranks in lockstep (``synced_gpus``) exactly for the modules it knows FSDP-managed, so the mark is lifted for the
    block (for a model whose forwards need no collective, e.g. its parameters held unsharded)."""
    marked = getattr(model, "_is_fsdp_managed_module", False)
    model._is_fsdp_managed_module = False
    try:
        yield
    finally:
        model._is_fsdp_managed_module = marked


def cache_argument(model: Any) -> str:
    """The name under which ``model``'s ``generate`` takes a KV cache: ``cache`` from transformers 5.24 (which still
    accepts, with a warning, the ``past_key_values`` of earlier releases)."""
    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@contextlib.contextmanager
def generating_on(trainer: Any, model: Any) -> Iterator[None]:
    """Inside the block TRL's ``GRPOTrainer._generate_single_turn`` decodes with transformers on ``model``: it takes
    the model to generate with from the ``Trainer``'s ``model_wrapped``, which is set to ``model`` for the block."""
    wrapped = trainer.model_wrapped
    trainer.model_wrapped = model
    try:
        yield
    finally:
        trainer.model_wrapped = wrapped


def tokenized_prompts(trainer: Any, prompts: list) -> tuple:
    """``(prompt_ids, images, multimodal_fields)`` of ``prompts`` as TRL's ``_generate`` tokenizes them for its
    ``_generate_single_turn`` (GRPO, RLOO, distillation)."""
    return trainer._tokenize_prompts(prompts)


def generation_setup(model: Any, generation_config: Any, model_kwargs: dict[str, Any]) -> Any:
    """What transformers' ``generate`` would decode ``model_kwargs`` (``input_ids``, ``attention_mask``) with on
    ``model`` for ``generation_config``, prepared by ``generate``'s own private
    steps (``_prepare_generation_config``: the model's generation config under the given one;
    ``_prepare_special_tokens``; ``_get_logits_processor``; ``_get_stopping_criteria``): a namespace of ``config`` (the
    prepared generation config), ``model_kwargs`` (what is left for the forward), ``processors``, ``criteria`` and
    ``pad_token_id`` (a tensor, or ``None``). Whoever decodes differently decides from these, not from its own reading
    of the config's fields, whether it decodes as ``generate`` would."""
    from types import SimpleNamespace

    from transformers import GenerationMixin, LogitsProcessorList, StoppingCriteriaList

    names = ("_prepare_generation_config", "_prepare_special_tokens", "_get_logits_processor", "_get_stopping_criteria")
    _checked("transformers:GenerationMixin", *names)
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"{type(model).__name__} does not generate with transformers' GenerationMixin.")
    config, model_kwargs = model._prepare_generation_config(generation_config, **model_kwargs)
    input_ids, attention_mask = model_kwargs["input_ids"], model_kwargs.get("attention_mask")
    batch_size, prompt_length = input_ids.shape
    model._prepare_special_tokens(config, attention_mask is not None, device=input_ids.device, batch_size=batch_size)
    if config.max_new_tokens is not None:
        config.max_length = prompt_length + config.max_new_tokens  # as generate sizes it
    if config.min_new_tokens is not None:
        config.min_length = prompt_length + config.min_new_tokens
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=prompt_length,
        encoder_input_ids=input_ids,
        logits_processor=LogitsProcessorList(),
        device=input_ids.device,
        model_kwargs={"attention_mask": attention_mask},
    )
    criteria = model._get_stopping_criteria(generation_config=config, stopping_criteria=StoppingCriteriaList())
    pad = getattr(config, "_pad_token_tensor", None)
    return SimpleNamespace(
        config=config, model_kwargs=model_kwargs, processors=processors, criteria=criteria, pad_token_id=pad
    )


def mark_vllm_weights_awake(generation: Any) -> None:
    """Tell TRL's ``VLLMGeneration`` that its engine's weights are awake and loaded: while its private
    ``_llm_weights_sleeping`` is set (sleep level 2 discarded them), its ``generate()`` pushes the weights again."""
    if not hasattr(generation, "_llm_weights_sleeping"):
        raise UnsupportedLibraryError(
            f"{_library_version('trl:x')}'s VLLMGeneration no longer has _llm_weights_sleeping: hf_odc cannot tell it "
            "that the weights it loaded after sleep are awake. Update hf_odc/_compat.py."
        )
    generation._llm_weights_sleeping = False


def router_modules(model: Any) -> list[tuple[Any, int]]:
    """The modules of ``model`` whose output (at the given index of a tuple) is a MoE layer's router logits: those a
    transformers model records as ``router_logits`` (its classes' private ``_can_record_outputs``, which is how
    ``output_router_logits`` collects them). Empty for a dense model."""
    from transformers import PreTrainedModel

    if not hasattr(PreTrainedModel, "_can_record_outputs"):
        raise UnsupportedLibraryError(
            f"{_library_version('transformers:x')}'s PreTrainedModel no longer has _can_record_outputs: hf_odc cannot "
            "find the MoE routers whose logits the load-balancing loss reads. Update hf_odc/_compat.py."
        )
    targets: dict[type, int] = {}
    for module in model.modules():
        recorders = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        for recorder in recorders if isinstance(recorders, list | tuple) else [recorders]:
            if isinstance(recorder, type):
                targets[recorder] = 0
            elif recorder is not None:
                targets[recorder.target_class] = recorder.index
    return [
        (module, index) for module in model.modules() for target, index in targets.items() if isinstance(module, target)
    ]


def is_vision_trainer(trainer: Any) -> bool:
    """Whether TRL built ``trainer`` for a vision-language model (``_is_vlm``, which TRL's GRPO and RLOO trainers set
    from their processing class); ``False`` for an object without it (a trainer of another kind)."""
    return bool(getattr(trainer, "_is_vlm", False))


def mark_distributed_loading(trainer: Any) -> None:
    """Tell the Trainer that hf_odc placed and prepared its model itself (its
    ``is_distributed_loading_by_transformers``), so that its ``prepare()`` leaves the model as it is. transformers
    reads the flag from 5.23 on, where a Trainer without it is refused; an earlier one leaves a prepared model as it
    is without it."""
    import transformers

    if tuple(int(part) for part in transformers.__version__.split(".")[:2]) >= (5, 23):
        _require(trainer, ("is_distributed_loading_by_transformers",), "transformers:Trainer", " instances")
    trainer.is_distributed_loading_by_transformers = True


def attn_implementation(config: Any) -> str | None:
    """The attention implementation ``config`` (a transformers ``PretrainedConfig``) is set to: its private
    ``_attn_implementation``, which the public ``attn_implementation`` argument sets. ``None`` when unset."""
    _checked("transformers:PretrainedConfig", "_attn_implementation")
    return getattr(config, "_attn_implementation", None)


def set_attn_implementation(config: Any, name: str) -> None:
    """Set the attention implementation of ``config`` before any model is built from it (its private
    ``_attn_implementation``: a model's public ``set_attn_implementation`` needs the model)."""
    _checked("transformers:PretrainedConfig", "_attn_implementation")
    config._attn_implementation = name


def model_from_config(cls: type, config: Any, **kwargs: Any) -> Any:
    """A model of the transformers class ``cls`` built from ``config`` without loading weights (its private
    ``_from_config``: ``PreTrainedModel`` has no public one, the ``AutoModel`` classes pick the class themselves)."""
    _checked("transformers:PreTrainedModel", "_from_config")
    return cls._from_config(config, **kwargs)


def no_split_modules(model: Any) -> set[str]:
    """The class names of ``model``'s layers that transformers keeps whole (its private ``_no_split_modules``, what
    Accelerate's ``TRANSFORMER_BASED_WRAP`` wraps); empty for a model that names none."""
    _checked("transformers:PreTrainedModel", "_no_split_modules")
    return set(getattr(model, "_no_split_modules", None) or ())


def padding_free_collator(pad_token_id: int) -> Any:
    """TRL's ``DataCollatorForLanguageModeling`` in its padding-free mode (the packing SFT trains with), which ``trl``
    does not export: it lives in ``trl.trainer.sft_trainer``."""
    collator = _checked("trl.trainer.sft_trainer", "DataCollatorForLanguageModeling").DataCollatorForLanguageModeling
    return collator(pad_token_id=pad_token_id, padding_free=True)


def trl_prepared_dataset(trainer: Any, dataset: Any, processing_class: Any, args: Any) -> Any | None:
    """``dataset`` as the ``__init__`` of ``trainer``'s TRL class (``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer`` or
    ``RewardTrainer``) prepares it for training with ``processing_class`` and ``args`` (its ``_prepare_dataset``:
    formatted, tokenized, truncated to ``args.max_length`` or filtered by it, the samples left with nothing to learn
    dropped), on ``trainer``, an instance whose ``__init__`` has not run: a launcher checks the data so before any
    process starts. The state ``_prepare_dataset`` reads is set first, as that ``__init__`` sets it, but for KTO's
    mismatched completions, which TRL chooses within each process's batch and the caller within each global batch.
    ``None`` where TRL would not prepare it (SFT's ``skip_prepare_dataset``); the caller leaves out vision datasets,
    which TRL processes on the fly."""
    sft = isinstance(trainer, _checked("trl:SFTTrainer", "_prepare_dataset"))
    kto = isinstance(trainer, _checked("trl:KTOTrainer", "_prepare_dataset"))
    others = (_checked(f"trl:{name}", "_prepare_dataset") for name in ("DPOTrainer", "RewardTrainer"))
    if not sft and not kto and not isinstance(trainer, tuple(others)):
        raise TypeError(f"{type(trainer).__name__} is not TRL's SFTTrainer, DPOTrainer, KTOTrainer or RewardTrainer.")
    processor = _checked("transformers:ProcessorMixin")
    trainer._tokenizer = processing_class.tokenizer if isinstance(processing_class, processor) else processing_class
    if kto:  # what its _prepare_dataset reads: the loss weights (TRL's note on their balance) and the KL switch
        trainer.desirable_weight, trainer.undesirable_weight = args.desirable_weight, args.undesirable_weight
        trainer.calculate_KL = False
    if not sft:
        return trainer._prepare_dataset(dataset, processing_class, args, "train")
    skip = bool(args.dataset_kwargs and args.dataset_kwargs.get("skip_prepare_dataset", False))
    if skip:
        return None
    templates = _checked("trl.chat_template_utils", "has_generation_markers", "get_training_chat_template")
    trainer.chat_template = None
    if args.assistant_only_loss and not templates.has_generation_markers(processing_class.chat_template):
        trainer.chat_template = templates.get_training_chat_template(processing_class)
    trainer.completion_only_loss = args.completion_only_loss
    if trainer.completion_only_loss is None:
        trainer.completion_only_loss = {"prompt", "completion"} <= set(dataset.column_names)
    return trainer._prepare_dataset(dataset, processing_class, args, args.packing, None, "train")


def library_logger(module: str) -> logging.Logger:
    """The logger a library module (``module``, e.g. ``"trl.trainer.grpo_trainer"``) logs with: its module-level
    ``logger``, unwrapped from Accelerate's adapter. A filter added to it sees what the module logs, which a logger
    looked up by a name that the module no longer uses would not."""
    logger = _checked(module, "logger").logger
    logger = getattr(logger, "logger", logger)  # accelerate.logging.get_logger's MultiProcessAdapter
    if not isinstance(logger, logging.Logger):
        raise UnsupportedLibraryError(
            f"{module}.logger is a {type(logger).__name__}, not a logger. Update hf_odc/_compat.py."
        )
    return logger


def default_store() -> Any:
    """The default process group's store (torch's private ``distributed_c10d._get_default_store``)."""
    return _checked("torch.distributed.distributed_c10d", "_get_default_store")._get_default_store()


def process_groups() -> list[Any]:
    """Every process group of the job (the default one, FSDP's mesh groups...): torch's private
    ``distributed_c10d._world``."""
    return list(_checked("torch.distributed.distributed_c10d", "_world")._world.pg_map)


def set_group_timeout(group: Any, timeout: timedelta) -> None:
    """``group``'s collectives time out after ``timeout`` from now on: ``torch.distributed.set_timeout`` (torch >=
    2.14), before it the private ``distributed_c10d._set_pg_timeout`` (which warns where the public one exists)."""
    import torch.distributed as dist

    set_timeout = getattr(dist, "set_timeout", None)
    if set_timeout is None:
        set_timeout = _checked("torch.distributed.distributed_c10d", "_set_pg_timeout")._set_pg_timeout
    set_timeout(timeout, group)


def dynamic_dimension(tensor: Any, dim: int) -> None:
    """Compile one graph for every size dimension ``dim`` of ``tensor`` takes, where the compiled code allows
    (torch's ``torch._dynamo.maybe_mark_dynamic``, before the compiled function is called with ``tensor``)."""
    _checked("torch._dynamo", "maybe_mark_dynamic").maybe_mark_dynamic(tensor, dim)


def symmetric_memory() -> ModuleType:
    """torch's private ``torch.distributed._symmetric_memory`` (CUDA symmetric memory), with what the CUDA transport
    calls of it checked."""
    return _checked("torch.distributed._symmetric_memory", "empty", "rendezvous", "get_backend", "set_backend")


SDPA_OPERATORS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
"""The aten operators ``scaled_dot_product_attention`` runs a fused kernel through (flash, memory-efficient, cuDNN,
CPU flash), each returning the output and the softmax statistics its backward reads; every torch hf_odc supports has
them."""


def attention_operators() -> list[Any]:
    """torch's attention operators as a dispatch mode sees them (the default overloads): :data:`SDPA_OPERATORS`,
    ``aten._scaled_dot_product_fused_attention_overrideable`` (other backends) where this torch has it, and
    ``torch_attn::_varlen_attn``, the custom operator ``torch.nn.attention.varlen.varlen_attn`` runs (opaque to a
    dispatch mode: the aten kernels it calls are not seen apart from it), from torch 2.10. SDPA's unfused (math)
    fallback decomposes into ordinary operators and has none."""
    import torch

    _require(torch.ops.aten, SDPA_OPERATORS, "torch.ops.aten", "")
    names = [*SDPA_OPERATORS, "_scaled_dot_product_fused_attention_overrideable"]
    operators = [getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)]
    with contextlib.suppress(ImportError):
        import torch.nn.attention.varlen  # registers torch_attn::_varlen_attn
    if hasattr(torch.ops.torch_attn, "_varlen_attn"):
        operators.append(torch.ops.torch_attn._varlen_attn.default)
    return operators

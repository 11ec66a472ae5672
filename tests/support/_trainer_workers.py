"""Worker functions for the trainer/plugin tests (run in spawned processes by ``_dist.launch``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.distributed.fsdp import FSDPModule


def shard_under_an_accelerate_fsdp_config(rank: int, world_size: int) -> dict:
    """Shard as the trainer does under an Accelerate FSDP2 config (TRANSFORMER_BASED_WRAP, bf16), then resolve the
    auto-wrap policy again, as ``Accelerator.prepare`` does on the already-sharded model."""
    from _models import tiny_qwen2_config
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import Qwen2ForCausalLM

    from hf_odc.accelerate_plugin import shard_model

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", mixed_precision_policy="bf16"
    )
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), device=torch.device("cpu"))
    torch.manual_seed(0)
    config = tiny_qwen2_config(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1)  # fmt: skip
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    shard_model(model, accelerator)
    plugin.set_auto_wrap_policy(model)  # raised "Could not find the transformer layer class" before the fix
    return {
        "groups": sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule)),
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "param_dtype": str(plugin.mixed_precision_policy.param_dtype),
    }

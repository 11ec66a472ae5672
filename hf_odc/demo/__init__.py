"""The demos' parts, shared by the example scripts (``examples/sft.py``, ``examples/dpo.py``, ...), the
notebooks and the tests: a word-level tokenizer built in code, models built from a config (a tiny Llama, or a real
model's shape with random weights), built-in datasets with long-tailed lengths (chats, token ids, prompts, preference
pairs), a tiny vision-language model with its processor and an image dataset, GRPO's rule-based rewards and synthetic
rollouts, the tool-calling demo's tool and scripted policy, and the scripts' command-line conventions.
Nothing downloads.

Nothing else in hf_odc imports this package: it is for trying ODC out, writing a script of one's own in the examples'
style, and testing; a real run brings its own model, tokenizer and data. This face holds what the examples, the
notebooks and the tests import; the rest stays in its module.
"""

from .data import chat_dataset, preference_dataset, prompt_dataset, synthetic_dataset, unpaired_dataset
from .inputs import quiet_datasets_on_other_ranks, require_columns
from .models import build_model, save_initial_model
from .rewards import echo_reward, length_reward
from .rollouts import SyntheticRollouts
from .script import (
    ExampleParser,
    GlobalBatchParser,
    GlobalBatchScriptArguments,
    PromptScriptArguments,
    built_in_prompts,
    initial_reference,
    load_script_dataset,
    make_trainer,
    policy_model_config,
    save_policy_for_reference,
    train_and_save,
)
from .tokenizer import build_tokenizer, load_tokenizer
from .tools import LookupScript, build_tool_tokenizer, lookup, scripted_generation, tool_use_reward
from .vision import (
    VISION_SHAPES,
    build_llava_model,
    build_llava_processor,
    build_vision_model,
    build_vision_processor,
    vision_dataset,
    vision_preference_dataset,
    vision_prompt_dataset,
)

__all__ = [
    "VISION_SHAPES",
    "ExampleParser",
    "GlobalBatchParser",
    "GlobalBatchScriptArguments",
    "LookupScript",
    "PromptScriptArguments",
    "SyntheticRollouts",
    "build_llava_model",
    "build_llava_processor",
    "build_model",
    "build_tokenizer",
    "build_tool_tokenizer",
    "build_vision_model",
    "build_vision_processor",
    "built_in_prompts",
    "chat_dataset",
    "echo_reward",
    "initial_reference",
    "length_reward",
    "load_script_dataset",
    "load_tokenizer",
    "lookup",
    "make_trainer",
    "policy_model_config",
    "preference_dataset",
    "prompt_dataset",
    "quiet_datasets_on_other_ranks",
    "require_columns",
    "save_initial_model",
    "save_policy_for_reference",
    "scripted_generation",
    "synthetic_dataset",
    "tool_use_reward",
    "train_and_save",
    "unpaired_dataset",
    "vision_dataset",
    "vision_preference_dataset",
    "vision_prompt_dataset",
]

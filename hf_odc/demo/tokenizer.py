"""The demos' tokenizer: a word-level vocabulary with ChatML's special tokens and chat template, built in code.

No download: every example, notebook and test trains with it when no model directory is given (:func:`load_tokenizer`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from trl import ModelConfig

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ROLES = ["system", "user", "assistant"]
NUM_WORDS = 500
# ChatML, with the assistant's reply and its end-of-turn token inside {% generation %} so that TRL's
# `assistant_only_loss` trains exactly those tokens (including the one that stops generation).
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(extra_tokens: Sequence[str] = (), chat_template: str = _CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``w0 .. w{NUM_WORDS-1}``, the role names and ChatML's special tokens, plus
    ``extra_tokens`` (placed before the words: the tool-calling demo's, :func:`hf_odc.demo.build_tool_tokenizer`),
    with ``chat_template``."""
    words = [f"w{i}" for i in range(NUM_WORDS)]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + ROLES + list(extra_tokens) + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=chat_template,
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""Either of them marks a directory that holds a tokenizer (``save_pretrained`` writes both)."""


def missing_tokenizer(path: str) -> str | None:
    """What the model directory ``path`` lacks to hold its tokenizer, in words, or ``None``."""
    if any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return None
    return (
        f"the directory holds no tokenizer ({' or '.join(TOKENIZER_FILES)}); save the model's own tokenizer there "
        "(tokenizer.save_pretrained): a model is never trained with another one"
    )


def load_tokenizer(model_args: ModelConfig) -> PreTrainedTokenizerFast:
    """The tokenizer of ``model_name_or_path`` (a directory, or a Hub name), else, with no model given, the built-in
    word-level one. A model directory without a tokenizer is refused (``ValueError``): its token ids mean nothing to
    another tokenizer."""
    path = model_args.model_name_or_path
    if not path:
        return build_tokenizer()
    if not os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path)
    missing = missing_tokenizer(path)
    if missing is not None:
        raise ValueError(f"{path}: {missing}")
    config_file = os.path.join(path, "tokenizer_config.json")
    generic = False
    if os.path.isfile(config_file):
        with open(config_file) as f:
            generic = json.load(f).get("tokenizer_class") == "TokenizersBackend"
    # transformers 5 may rebuild a generic tokenizer.json as the model type's tokenizer class (Qwen2's byte-level BPE
    # for the outputs of this example's Qwen2-shaped models), which breaks a word-level vocabulary; load it as it is.
    return PreTrainedTokenizerFast.from_pretrained(path) if generic else AutoTokenizer.from_pretrained(path)

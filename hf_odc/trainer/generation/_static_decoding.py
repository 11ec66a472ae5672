"""hf_odc's own decoding loop for :class:`~hf_odc.trainer.generation.decoders.StaticDecoder`'s copy, where it decodes
what transformers' ``generate`` would.

Why: transformers' ``generate`` runs Python per token (its logits processors, stopping criteria and a check of
``unfinished_sequences.max() == 0`` that makes the host wait for the device every token), so the host's time and the
device's add up instead of overlapping. Here one decoding step (the forward of one token per row into the kept static KV
cache, the next token chosen from its logits, finished rows given the pad token) reads and writes only tensors of a
static shape that live as long as the cache, so on a GPU it is recorded once in a CUDA graph and replayed per token; the
host asks whether every row has finished only every :data:`_CHECK_EVERY` steps and cuts the steps run past that.
hf_odc's decoding attention reads only the filled part of the cache: where its kernel runs
(:func:`hf_odc.kernels.decode_attention.kernel_runs`) it skips the blocks the mask does not hold, so the step is given
the cache's whole width and one CUDA graph serves every step (and a row that has ended at an EOS, whose later tokens are
cut, attends only to its newest slot, so the kernel skips its cache: a batch's long tail reads only the rows still
decoding); elsewhere it reads the cache up to the mask's width, the filled part rounded up to the next multiple of
:data:`_WIDTH_MULTIPLE` slots (one CUDA graph per such width, at most :data:`_MAX_WIDTHS` of them). The forward inside
the graph is compiled (``torch.compile``, by the eager warm-up steps before the first recording), so the graph replays
fused kernels rather than the eager forward's many small ones; where the widths vary, the width is a dimension of the
compiled forward, not a constant of it (one width compiles statically), and the cache holds one slot more than the loop
ever fills (:func:`cache_slots`), so that no width reads the cache whole: the keys the attention reads are a slice with
the same strides at every width (read whole, they would be contiguous, and compiled a second time), and one compile
serves every width. Compiled by layer (``compile_layers``, the default), the forward runs eagerly inside the graph
but for the decoder layers, which share one compiled body (:class:`_CompiledModules`: the layers are alike but for
their weights and their part of the cache), and the base model's final norm and rotary embedding, each compiled on its
own: one layer is traced and compiled instead of the unrolled forward's every layer, which cuts the first batch's
compile several times over, but nothing fuses across a layer's edge (the residual addition that ends a layer runs
apart from the next layer's normalisation), and the prefill runs eagerly. A copy whose forward holds collectives
(:class:`~hf_odc.trainer.generation.decoders.TensorParallelDecoder`'s all-reduces) records its eager forward. On a
CPU the same step runs eagerly.

It decodes only what it decodes exactly as ``generate`` does (:func:`decoding_plan`): greedy or multinomial sampling
with any of a repetition penalty, temperature, top-k, top-p and min-p as transformers' processors define them, and
stopping at EOS or ``max_new_tokens``. transformers itself builds the processors and stopping criteria for the call
(:func:`hf_odc._compat.generation_setup`); any other one, any other generation option that ``generate`` honours
(beam search, several return sequences, a dict output, a streamer, logits processors or stopping criteria passed by
the caller...), another attention or cache layout, another model input, or a ``generate`` other than
transformers' own (a model's, or one wrapped around it) is left to ``generate``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F
from transformers import GenerationMixin, PreTrainedModel, StaticCache
from transformers.generation import (
    EosTokenCriteria,
    GenerationMode,
    MaxLengthCriteria,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ... import _compat
from ...kernels.decode_attention import kernel_runs
from ..core.attention import attention_shape

_CHECK_EVERY = 16
"""Decoding steps between two checks (one host-device synchronisation) of whether every row has finished; the steps
run after that are cut from the output."""

_WIDTH_MULTIPLE = 256
"""The attention's cache width is the filled length rounded up to this, or to a larger multiple of it where the cache
would otherwise have more than :data:`_MAX_WIDTHS` widths (one CUDA graph per width)."""

_MAX_WIDTHS = 8
"""The most widths a cache is read at: each is recorded in a CUDA graph of its own (the compiled forward serves them
all)."""

_WARMUP_STEPS = 2
"""Eager steps on a side stream before a step is recorded in a CUDA graph, as CUDA graphs require (they are real
decoding steps, not thrown away)."""

_ATTENTIONS = ("eager", "sdpa", "odc_decoding")
"""The attentions whose decoding step the loop masks itself: transformers' eager attention (an additive mask of the
cache's full width), its SDPA (a boolean one) and
:func:`~hf_odc.trainer.generation.decoders.grouped_decoding_attention`, registered as ``decoders.DECODING_ATTENTION`` (a
boolean mask, which may be narrower than the cache: the attention then reads the cache only that far)."""

_PROCESSOR_ORDER = (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
)
"""The logits processors :func:`processed_scores` applies, in the order transformers applies them."""


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the last logits, as transformers' processors define it: with
    ``repetition_penalty``, the logits of the tokens already in a row (its prompt from its first attended token on,
    and what it generated) are divided by it where positive, multiplied where negative; without ``do_sample`` the
    highest then wins; with it, the logits are divided by ``temperature``, cut to the ``top_k`` highest, to the
    highest whose probabilities sum past ``top_p``, and to those with at least ``min_p`` times the top probability
    (each keeping at least one token), and a token is drawn from their softmax. ``None`` leaves a step out."""

    do_sample: bool
    repetition_penalty: float | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None


@dataclass(frozen=True)
class DecodingPlan:
    """What :func:`decoding_plan` found the loop decodes a call with: the prompts, at most ``max_new_tokens`` new
    tokens, ``sampling``, the ``eos_token_ids`` that end a row (none: rows end only at the length) and the
    ``pad_token_id`` finished rows are given."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_new_tokens: int
    sampling: Sampling
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None


def cache_slots(length: int) -> int:
    """The slots of the static cache the loop decodes up to ``length`` tokens into: one more, never filled, so that
    the attention never reads the cache whole (see the module docstring)."""
    return length + 1


def decoding_plan(
    model: PreTrainedModel, cache: StaticCache, cache_length: int, config: Any, args: tuple, kwargs: dict[str, Any]
) -> DecodingPlan | None:
    """The :class:`DecodingPlan` for a ``generate(*args, generation_config=config, **kwargs)`` call on ``model`` with
    the kept ``cache`` of ``cache_length`` slots (``kwargs`` what ``config.update`` left: model inputs and
    ``generate``'s own arguments), or ``None`` where the loop would not decode exactly as transformers' ``generate``
    does (see the module docstring)."""
    inputs = dict(kwargs)
    if args:
        if len(args) > 1 or "input_ids" in inputs:
            return None
        inputs["input_ids"] = args[0]
    if set(inputs) != {"input_ids", "attention_mask"}:
        return None  # inputs_embeds, images, logits processors, stopping criteria, a streamer... or no mask
    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    if not _decodes(model, cache, input_ids, attention_mask) or config.stop_strings is not None:
        return None  # (stop strings need a tokenizer to be set up at all)
    setup = _compat.generation_setup(model, config, inputs)
    prepared = setup.config
    if set(setup.model_kwargs) != {"input_ids", "attention_mask"}:
        return None  # e.g. output_attentions, which generate forwards to the model
    if prepared.get_generation_mode() not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return None
    if prepared.return_dict_in_generate or prepared.num_return_sequences not in (None, 1) or prepared.is_assistant:
        return None
    if prepared.prefill_chunk_size is not None or prepared.token_healing or prepared.use_cache is False:
        return None
    new_tokens = prepared.max_new_tokens
    if new_tokens is None or not 0 < new_tokens <= cache_length - input_ids.shape[1]:
        return None
    sampling = _sampling(setup.processors, bool(prepared.do_sample))
    eos = eos_token_ids(setup.criteria)
    if sampling is None or eos is None:
        return None
    pad = None if setup.pad_token_id is None else int(setup.pad_token_id)
    if eos and pad is None:
        return None
    return DecodingPlan(input_ids, attention_mask, new_tokens, sampling, eos, pad)


def _decodes(model: PreTrainedModel, cache: StaticCache, input_ids: Any, attention_mask: Any) -> bool:
    """Whether the loop's step is ``model``'s decoding step: a decoder-only model that generates and prepares its
    inputs as ``GenerationMixin`` does (no multimodal or 3-D positions; transformers' ``generate`` not replaced), an
    attention of :data:`_ATTENTIONS`, a cache of full attention layers only, left- or un-padded prompts with their
    0/1 mask on the model's device."""
    if model.config.is_encoder_decoder or getattr(model, "create_masks_for_generate", None) is not None:
        return False
    generate = type(model).generate  # a model's own, or a wrapper around transformers' (a patch), decides itself
    if generate is not GenerationMixin.generate or generate.__module__ != GenerationMixin.__module__:
        return False
    if type(model).prepare_inputs_for_generation is not GenerationMixin.prepare_inputs_for_generation:
        return False
    parameters = inspect.signature(type(model).forward).parameters
    if "logits_to_keep" not in parameters or _compat.attn_implementation(model.config) not in _ATTENTIONS:
        return False
    if any(cache.is_sliding) or any(getattr(cache, "is_linear", ())):
        return False
    if not (isinstance(input_ids, torch.Tensor) and isinstance(attention_mask, torch.Tensor)):
        return False
    if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape or input_ids.shape[1] == 0:
        return False
    if input_ids.dtype != torch.long or input_ids.device != model.device or attention_mask.device != model.device:
        return False
    return bool(((attention_mask == 0) | (attention_mask == 1)).all())


def _sampling(processors: list, do_sample: bool) -> Sampling | None:
    """The :class:`Sampling` that transformers' ``processors`` apply (each of :data:`_PROCESSOR_ORDER` at most once,
    in that order, filtering to ``-inf`` and keeping at least one token), or ``None`` for any other list."""
    found: dict[type, Any] = {}
    last = -1
    for processor in processors:
        kind = type(processor)
        if kind not in _PROCESSOR_ORDER or _PROCESSOR_ORDER.index(kind) <= last:
            return None
        last = _PROCESSOR_ORDER.index(kind)
        keeps, fills = getattr(processor, "min_tokens_to_keep", 1), getattr(processor, "filter_value", -math.inf)
        if keeps != 1 or fills != -math.inf:
            return None
        found[kind] = processor
    penalty = found.get(RepetitionPenaltyLogitsProcessor)
    temperature, top_k = found.get(TemperatureLogitsWarper), found.get(TopKLogitsWarper)
    top_p, min_p = found.get(TopPLogitsWarper), found.get(MinPLogitsWarper)
    return Sampling(
        do_sample=do_sample,
        repetition_penalty=None if penalty is None else float(penalty.penalty),
        temperature=None if temperature is None else float(temperature.temperature),
        top_k=None if top_k is None else int(top_k.top_k),
        top_p=None if top_p is None else float(top_p.top_p),
        min_p=None if min_p is None else float(min_p.min_p),
    )


def eos_token_ids(criteria: list) -> tuple[int, ...] | None:
    """The EOS ids among transformers' stopping ``criteria`` (the length is the loop's own), or ``None`` where there
    is any other criterion."""
    eos: tuple[int, ...] = ()
    for criterion in criteria:
        if isinstance(criterion, EosTokenCriteria):
            eos += tuple(int(token) for token in criterion.eos_token_id.reshape(-1).tolist())
        elif not isinstance(criterion, MaxLengthCriteria):
            return None
    return eos


def processed_scores(scores: torch.Tensor, sampling: Sampling, seen: torch.Tensor | None = None) -> torch.Tensor:
    """``scores`` (the last logits in float32, ``[batch, vocab]``) after ``sampling``'s processors, as transformers'
    ``RepetitionPenaltyLogitsProcessor``, ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``
    and ``MinPLogitsWarper`` give them (``min_tokens_to_keep=1``; the warpers only when sampling). ``seen`` (bool,
    ``[batch, vocab]``) marks the tokens the repetition penalty applies to. Static shapes, no host synchronisation."""
    if sampling.repetition_penalty is not None:
        penalty = sampling.repetition_penalty
        scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
    if not sampling.do_sample:
        return scores
    if sampling.temperature is not None:
        scores = scores / sampling.temperature
    if sampling.top_k is not None:
        kth = torch.topk(scores, min(sampling.top_k, scores.shape[-1]))[0][..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if sampling.top_p is not None:
        ascending, order = torch.sort(scores, descending=False)
        cut = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
        cut[..., -1:] = False
        scores = scores.masked_fill(cut.scatter(1, order, cut), -math.inf)
    if sampling.min_p is not None:
        probs = scores.softmax(dim=-1)
        cut = probs < sampling.min_p * probs.amax(dim=-1, keepdim=True)  # never the top token (min_p <= 1)
        scores = scores.masked_fill(cut, -math.inf)
    return scores


def sample(probs: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from ``probs``: the exponential race ``torch.multinomial`` runs for one sample (the
    same draw for the same generator state), written out so that a CUDA graph records it (the generator's offset
    advances on each replay) with no host synchronisation."""
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


class _LayerCache:
    """One layer's part of the static cache (a ``StaticCache``'s layer), given to that layer's forward in place of the
    whole cache: its ``update`` writes this part whatever layer index it is given, so the compiled layer body reads no
    index and serves every layer."""

    def __init__(self, layer: Any):
        self.layer = layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer.update(key_states, value_states, *args, **kwargs)


def _module_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A module's own forward (the body :class:`_CompiledModules` compiles)."""
    return type(module).forward(module, *args, **kwargs)


class _CompiledModules:
    """The copy's decoder layers, and the base model's other modules that run at each step (its children but the
    layers and the embeddings: the final norm, the rotary embedding), each run by a compiled body inside the loop's
    decoding step (:meth:`active`) and eagerly elsewhere (the prefill, whose prompt lengths vary): see the module
    docstring. What is left between them (the embedding's lookup, the LM head's product) runs eagerly.

    Why the layers compile once: torch compiles a function called with a module for every module of the same class
    and parameter shapes (a module is an input, not a constant, to the compiled code), but transformers' layers index
    the cache by their own ``layer_idx``, on which the code would specialise (one compile per layer). Each layer is
    given its own part of the cache (:class:`_LayerCache`), so the body never reads the index.

    Args:
        model: the copy.
        layers: its decoder layers with the cache layer each writes (:meth:`layers`).
    """

    def __init__(self, model: PreTrainedModel, layers: list[tuple[torch.nn.Module, int]]):
        self._body = torch.compile(_module_forward, dynamic=False)
        self._argument = _compat.cache_argument(model)
        self._on = False
        for module, index in layers:
            module.forward = functools.partial(self._forward, module, index)
        for module in _step_modules(model, layers[0][0]):
            module.forward = functools.partial(self._forward, module, None)

    @staticmethod
    def layers(model: PreTrainedModel) -> list[tuple[torch.nn.Module, int]] | None:
        """``model``'s decoder layers (the classes transformers keeps whole) with the cache layer each writes (its
        attention's ``layer_idx``), or ``None`` where a layer names none."""
        kept, layers = _compat.no_split_modules(model), []
        for module in model.modules():
            if type(module).__name__ in kept:
                index = next(
                    (m.layer_idx for m in module.modules() if isinstance(getattr(m, "layer_idx", None), int)), None
                )
                if index is None:
                    return None
                layers.append((module, index))
        return layers or None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block the modules run their compiled bodies."""
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def _forward(self, module: torch.nn.Module, index: int | None, *args: Any, **kwargs: Any) -> Any:
        if not self._on:
            return _module_forward(module, *args, **kwargs)
        cache = kwargs.get(self._argument) if index is not None else None
        if cache is not None:
            kwargs[self._argument] = _LayerCache(cache.layers[index])
        return self._body(module, *args, **kwargs)


def _step_modules(model: torch.nn.Module, layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The other children of the module whose list holds the decoder ``layer`` (the base model), but its embeddings."""
    for owner in model.modules():
        for child in owner.children():
            if isinstance(child, torch.nn.ModuleList) and any(member is layer for member in child):
                return [m for m in owner.children() if m is not child and not isinstance(m, torch.nn.Embedding)]
    return []


class Loop:
    """The decoding loop for one kept cache (one batch size and cache length): its buffers, and on a GPU the CUDA
    graphs of its step, live as long as the cache (:class:`~hf_odc.trainer.generation.decoders.StaticDecoder` makes a
    new one with a new cache).

    Args:
        model: the static copy.
        cache: the kept static cache.
        batch_size: the cache's rows.
        length: the longest prompt and completion it decodes (the cache holds :func:`cache_slots` of it).
        compile: record (or on a CPU run) the compiled forward (see the module docstring), else the eager one.
        compile_layers: compile it by layer (see the module docstring): from then on, inside a decoding step, every
            decoder layer of ``model`` (the classes transformers keeps whole, each naming its cache layer by a
            ``layer_idx``; else the whole forward is compiled) runs one compiled body, and the final norm and the
            rotary embedding each their own.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cache: StaticCache,
        batch_size: int,
        length: int,
        compile: bool = True,
        compile_layers: bool = False,
    ):
        self.model, self.cache, self.length = model, cache, length
        device = model.device
        self._cache_kwargs = {_compat.cache_argument(model): cache}
        attention = _compat.attn_implementation(model.config)
        self._additive_mask = attention == "eager"
        # Reads only the mask's width of the cache (see _ATTENTIONS), unless its kernel reads only what is filled.
        self._narrow = attention == "odc_decoding" and not kernel_runs(device, attention_shape(model)[2])
        multiple = math.ceil(length / _MAX_WIDTHS / _WIDTH_MULTIPLE) * _WIDTH_MULTIPLE
        self._width_multiple = max(_WIDTH_MULTIPLE, multiple)
        layers = _CompiledModules.layers(model) if compile and compile_layers else None
        self._compiled = _CompiledModules(model, layers) if layers else None
        self._forward = self._eager_forward
        if compile and self._compiled is None:
            self._forward = torch.compile(self._eager_forward, dynamic=False)
        slots = cache_slots(length)  # (the other attentions read the whole cache: one width, that of its mask)
        self._ids = torch.zeros(batch_size, slots, dtype=torch.long, device=device)  # prompt, then completion
        self._attended = torch.zeros(batch_size, slots, dtype=torch.bool, device=device)  # the 2-D mask
        self._token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # the last chosen token
        self._positions = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # its position id
        self._next_slot = torch.zeros(1, dtype=torch.long, device=device)  # where the next chosen token goes
        self._unfinished = torch.ones(batch_size, dtype=torch.bool, device=device)
        self._steps = torch.zeros((), dtype=torch.long, device=device)  # steps begun with a row unfinished
        self._pad = torch.zeros((), dtype=torch.long, device=device)
        self._is_eos: torch.Tensor | None = None  # [vocab], made with the first logits
        self._seen: torch.Tensor | None = None  # [batch, vocab], for a repetition penalty
        self._plan: DecodingPlan | None = None
        self.log_prob_temperature: float | None = None
        """Set: each call also records the chosen tokens' log-probabilities under the logits divided by it (the
        trainer's scoring, without the sampling's other processors), :attr:`last_log_probs`."""
        self.last_log_probs: torch.Tensor | None = None
        self._log_probs: torch.Tensor | None = None  # [batch, length], filled slot by slot as _ids
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._warmups: dict[tuple, int] = {}
        self._pool: Any = None  # the graphs' shared memory pool: they replay one at a time
        self._side_stream: torch.cuda.Stream | None = None

    def release(self) -> None:
        """Free the CUDA graphs. A graph that recorded a collective (tensor-parallel's all-reduces) holds its NCCL
        communicator, which the process group then cannot destroy (``destroy_process_group`` waits for ever): release
        the loop before the process groups go."""
        if self._graphs:
            torch.cuda.synchronize(self._ids.device)
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._warmups.clear()
        self._pool = None

    @torch.no_grad()
    def decode(self, plan: DecodingPlan) -> torch.Tensor:
        """The prompts and their completions, as transformers' ``generate`` returns them for ``plan``: ``[batch,
        prompt + n]``, ``n`` the steps until every row has ended (or ``max_new_tokens``), a row's tokens after its
        EOS the pad token. The cache must be empty (reset) and hold the prompts and ``max_new_tokens`` more."""
        prompt_length = plan.input_ids.shape[1]
        self._plan = plan
        if self.log_prob_temperature is not None and self._log_probs is None:
            self._log_probs = torch.zeros(self._ids.shape, dtype=torch.float32, device=self._ids.device)
        logits = self._prefill(plan)
        self._start(plan, logits.shape[-1])
        self._choose(logits)
        width_multiple, width = self._width_multiple, self._attended.shape[1]
        for chosen in range(1, plan.max_new_tokens):
            if plan.eos_token_ids and chosen % _CHECK_EVERY == 0 and not bool(self._unfinished.any()):
                break
            if self._narrow:  # the step forwards the token at slot prompt_length + chosen - 1: read the slots to it
                width = min(self.length, math.ceil((prompt_length + chosen) / width_multiple) * width_multiple)
            self._run_step(width)
        steps = int(self._steps)
        self.last_log_probs = None
        if self.log_prob_temperature is not None:
            self.last_log_probs = self._log_probs[:, prompt_length : prompt_length + steps].clone()
        return self._ids[:, : prompt_length + steps].clone()

    def _prefill(self, plan: DecodingPlan) -> torch.Tensor:
        """The prompts' forward into the cache, its inputs prepared as ``generate`` prepares them (position ids from
        the mask; no mask where nothing is padded): the last logits, in float32."""
        mask = plan.attention_mask
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        self._positions.copy_(positions[:, -1:] + 1)
        inputs = self.model.prepare_inputs_for_generation(
            plan.input_ids,
            attention_mask=None if bool((mask == 1).all()) else mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            is_first_iteration=True,
            **self._cache_kwargs,
        )
        return self.model(**inputs, return_dict=True).logits[:, -1].to(dtype=torch.float32, copy=True)

    def _start(self, plan: DecodingPlan, vocab: int) -> None:
        """Fill the buffers for a new call (outside any graph: the steps read them in place)."""
        prompt_length = plan.input_ids.shape[1]
        device = self._ids.device
        self._ids[:, :prompt_length].copy_(plan.input_ids)
        self._attended.zero_()
        self._attended[:, :prompt_length].copy_(plan.attention_mask.bool())
        self._next_slot.fill_(prompt_length)
        self._unfinished.fill_(True)
        self._steps.zero_()
        self._pad.fill_(plan.pad_token_id if plan.pad_token_id is not None else 0)
        if self._is_eos is None:
            self._is_eos = torch.zeros(vocab, dtype=torch.bool, device=device)
        self._is_eos.zero_()
        eos = [token for token in plan.eos_token_ids if 0 <= token < vocab]  # others are never generated
        self._is_eos[torch.tensor(eos, dtype=torch.long, device=device)] = True
        if plan.sampling.repetition_penalty is not None:
            if self._seen is None:
                self._seen = torch.zeros(self._ids.shape[0], vocab, dtype=torch.bool, device=device)
            # As transformers' processor: the prompt from its first attended token on, ids beyond the vocab dropped.
            start = (plan.attention_mask != 0).int().argmax(dim=1)
            counted = torch.arange(prompt_length, device=device)[None, :] >= start[:, None]
            ids = plan.input_ids.clamp(max=vocab).masked_fill(~counted, vocab)
            seen = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=device).scatter_(1, ids, True)
            self._seen.copy_(seen[:, :vocab])

    def _choose(self, logits: torch.Tensor) -> None:
        """Choose each row's next token from its last ``logits`` (float32) and record it (the output, the mask, the
        next step's input, the rows it ends), in place."""
        plan = self._plan
        self._steps.add_(self._unfinished.any())
        scores = processed_scores(logits, plan.sampling, self._seen)
        tokens = sample(F.softmax(scores, dim=-1)) if plan.sampling.do_sample else torch.argmax(scores, dim=-1)
        if plan.eos_token_ids:
            tokens = torch.where(self._unfinished, tokens, self._pad)
            self._unfinished.logical_and_(~self._is_eos[tokens])
            # An ended row attends only to its newest slot from now on (set below): what it decodes is cut, and the
            # decoding kernel skips the blocks its mask no longer holds.
            self._attended.logical_and_(self._unfinished[:, None])
        self._ids.index_copy_(1, self._next_slot, tokens[:, None])
        if self.log_prob_temperature is not None:
            chosen = F.log_softmax(logits / self.log_prob_temperature, dim=-1).gather(1, tokens[:, None])
            self._log_probs.index_copy_(1, self._next_slot, chosen)
        self._attended.index_fill_(1, self._next_slot, True)
        self._token.copy_(tokens[:, None])
        if self._seen is not None and plan.sampling.repetition_penalty is not None:
            self._seen.scatter_(1, tokens[:, None], True)
        self._next_slot.add_(1)

    def _eager_forward(self, mask: torch.Tensor) -> torch.Tensor:
        """The last chosen token's forward into the cache, attending to the slots ``mask`` holds (the 2-D mask's first
        ``width``, ``[batch, 1, 1, width]``): its logits, in float32. Passing the 4-D mask the model would build (the
        2-D mask already holds the causal order: no slot beyond the token is filled) keeps transformers' mask code,
        which reads values on the host, out of the step."""
        if self._additive_mask:
            dtype = self.model.dtype
            mask = torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)
        out = self.model(
            input_ids=self._token,
            attention_mask=mask,
            position_ids=self._positions,
            use_cache=True,
            return_dict=True,
            **self._cache_kwargs,
        )
        return out.logits[:, -1].to(dtype=torch.float32)

    def _step(self, width: int) -> None:
        """One decoding step: static shapes only, every result written into the loop's buffers. Where the loop narrows
        the width, it is a dimension of the compiled forward's mask, not a constant of it: one compiled forward serves
        every width."""
        mask = self._attended[:, None, None, :width].contiguous()  # (strides of one pattern for every width)
        if self._narrow:
            _compat.dynamic_dimension(mask, 3)
        with self._compiled.active() if self._compiled is not None else contextlib.nullcontext():
            logits = self._forward(mask)
        self._positions.add_(1)
        self._choose(logits)

    def _run_step(self, width: int) -> None:
        """:meth:`_step`, on a GPU replayed from its CUDA graph for this width and plan (recorded after
        :data:`_WARMUP_STEPS` eager steps on a side stream)."""
        if self._ids.device.type != "cuda":
            self._step(width)
            return
        key = (width, self._plan.sampling, bool(self._plan.eos_token_ids), self.log_prob_temperature)
        graph = self._graphs.get(key)
        if graph is None and self._warmups.get(key, 0) < _WARMUP_STEPS:
            self._warmups[key] = self._warmups.get(key, 0) + 1
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self._ids.device)
            self._side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._side_stream):
                self._step(width)
            torch.cuda.current_stream().wait_stream(self._side_stream)
            return
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            # Records only (the replay below runs the step); other threads (process groups' watchdogs, ODC's
            # transport) may go on using CUDA meanwhile.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._step(width)
            self._pool = graph.pool()
            self._graphs[key] = graph
        graph.replay()

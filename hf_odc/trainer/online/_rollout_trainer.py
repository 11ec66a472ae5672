"""What the online trainers (GRPO, RLOO, distillation) share: :class:`_ODCRolloutTrainer`, TRL's generation and
scoring with the rollouts re-planned across ranks, the old/reference passes deferred and packed.

Hook by hook (the step loop, sharding, ODC, the timings, bounded collectives and checkpoints are every ODC trainer's:
:class:`hf_odc.trainer.core._base_trainer._ODCTrainer`):

* ``__init__``: the reference model (frozen) is sharded by hf_odc and ODC installed on it, like the policy
  (:meth:`_setup_generation`, after :meth:`_setup_odc`); a PEFT policy's reference is the same sharded model with its
  adapter disabled (:func:`hf_odc.trainer.core._reference.reference_of`).
* ``_generate``, ``_generate_single_turn``, ``_tool_call_loop``: TRL's, in the run's generation mode, whose owner
  (:func:`hf_odc.trainer.generation.modes.make_generator`, chosen once) is called at each: around the generation batch,
  around its turns (held through TRL's tool loop: GRPO's ``tools``, ``environment_factory``), and at the run's end.
  ``_generate`` records each completion's true length, tool results included (TRL pads them).
* ``_get_per_token_logps_and_entropies``: while a training generation batch is scored, the old- and reference-policy
  passes are deferred (a placeholder is returned); they run afterwards, packed and balanced (``_score_rollouts``).
* ``_plan_step``: once per ``steps_per_generation * num_iterations`` calls of ``training_step``, TRL generates and
  scores; then every rank gathers the rollouts, cuts and plans the minibatches (:mod:`hf_odc.trainer.online.rollouts`),
  and runs the deferred passes the trainer asks for (:meth:`_deferred_passes`) on its own packed microbatches inside
  forward-only minibatches, then the trainer's :meth:`_after_scoring`. Each optimizer step then takes its planned
  minibatch. Evaluation is TRL's.
* ``get_batch_samples``, ``model_wrapped``, ``train``: with ``max_rollout_staleness=1``
  (:mod:`hf_odc.trainer.online._overlap`), the Trainer's loader is read ahead for the next generation batch's prompts,
  which :meth:`_decode_ahead` starts decoding in a background thread on the static copy once a batch is planned;
  ``_generate_single_turn`` takes its result, and the batch's ratio is against the behaviour log-probabilities scored
  there (no old-policy pass). ``model_wrapped`` is kept per thread, so that TRL's generation in the thread reads the
  copy while the main thread reads the policy; the run's end waits for the thread within the ODC timeout (a failed
  run does not).

The trainer (``ODCGRPOTrainer``, ``ODCRLOOTrainer``, ``ODCDistillationTrainer``) adds its loss
(``_microbatch_loss``), its metrics and the two hooks above.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from ... import _compat
from ...accelerate_plugin import ODCRuntime
from ..core._base_config import whole_model_kwargs
from ..core._base_trainer import _ODCTrainer
from ..core._quiet import without_checkpointing_alias_warning, without_ignored_model_init_kwargs_warning
from ..core._reference import shard_reference
from ..core.vision import check_vision_model
from ..generation.modes import make_generator, uses_tools
from ._overlap import Lookahead, Prefetch, behaviour_log_probs, recording_log_probs
from ._vision_rollouts import rollout_images
from .rollouts import Rollouts, RolloutStep, gather_rollouts, plan_generation_batch

# A deferred pass: the model, its runtime, the context to run it in, and the key its log-probabilities are stored under.
Pass = tuple[nn.Module, ODCRuntime, contextlib.AbstractContextManager, str]


class _ODCRolloutTrainer(_ODCTrainer):
    """The ODC side of an online TRL trainer that generates and scores rollouts (a mixin placed before the TRL class,
    whose ``__init__`` takes ``model`` and ``args`` by name). The subclass calls :meth:`_setup_odc`, then
    :meth:`_setup_generation`, and implements :meth:`_deferred_passes` and ``_microbatch_loss``."""

    _trains_vision: ClassVar[bool] = True
    """Whether the trainer trains a vision-language policy (TRL's processor as ``processing_class``)."""

    def __init__(self, model: Any, args: Any, **kwargs: Any):
        self._deferring_scores = False
        self._completion_lengths: list[int] = []
        # max_rollout_staleness=1: the batch decoded ahead, the loader read ahead, and the behaviour log-probabilities
        # of the batch taken from the thread (None for a batch decoded synchronously)
        self._owner_thread, self._this_thread = threading.get_ident(), threading.local()
        self._prefetch, self._lookahead = Prefetch(), Lookahead(iter(()))
        self._behaviour_logps: list[torch.Tensor] | None = None
        quiet = contextlib.nullcontext()
        if args.model_init_kwargs is None and self._loads_a_model(model, args, kwargs):
            args.model_init_kwargs = whole_model_kwargs(None)
            if not isinstance(model, str):
                quiet = without_ignored_model_init_kwargs_warning(type(self))  # not ignored: the reference uses them
        with quiet:
            super().__init__(model=model, args=args, **kwargs)

    def _loads_a_model(self, model: Any, args: Any, kwargs: dict[str, Any]) -> bool:
        """Whether TRL will load a model by name with ``model_init_kwargs``: the policy, the reference model
        (``beta > 0`` without PEFT) or a reward model."""
        funcs = kwargs.get("reward_funcs")
        funcs = funcs if isinstance(funcs, list) else [funcs]
        return isinstance(model, str) or args.beta != 0.0 or any(isinstance(func, str) for func in funcs)

    def _setup_generation(self) -> None:
        """After :meth:`_setup_odc`: the reference model (if any) sharded, then the generation mode's owner (the
        default mode is chosen by the device memory left; vLLM's weight sync is installed). A vision-language policy
        (TRL's processor as ``processing_class``) is checked (:func:`~hf_odc.trainer.core.vision.check_vision_model`)
        and its ``get_rope_index`` kept: its rollouts carry their images and 3-D positions."""
        self._rope_index = None
        if _compat.is_vision_trainer(self):
            if not self._trains_vision:
                raise NotImplementedError(
                    f"{type(self).__name__} trains text-only policies; pass a tokenizer as processing_class, not a "
                    "processor."
                )
            model = self.accelerator.unwrap_model(self.model)
            self._rope_index = check_vision_model(model, type(self).__name__, self.args.sp_size)
        self._ref_odc = shard_reference(self)
        self._generator = make_generator(self)
        self._generation_index = 0
        if self.args.max_rollout_staleness and (uses_tools(self) or getattr(self, "rollout_func", None) is not None):
            raise ValueError(
                f"{type(self).__name__}: max_rollout_staleness=1 decodes each generation batch in one call on the "
                "'static' copy, ahead; tools, environments and a rollout_func generate otherwise. Set "
                "max_rollout_staleness=0."
            )
        if self.args.max_rollout_staleness and self.args.checkpoints_activations and _drops_out(self.model):
            raise ValueError(
                f"{type(self).__name__}: with max_rollout_staleness=1 the activation checkpoints do not restore the "
                "random generators (the thread decoding ahead samples from them), so a policy with dropout would "
                "recompute other masks than its forward drew. Set the model's dropout to 0, turn off gradient "
                "checkpointing, or set max_rollout_staleness=0."
            )

    @property
    def model_wrapped(self) -> Any:
        """The Trainer's outermost model, as the thread that built the trainer set it; in another thread (the one
        decoding ahead with ``max_rollout_staleness=1``), what that thread set (the decoding copy), so that TRL's
        generation there never changes the model the main thread sees."""
        mine = getattr(self._this_thread, "model_wrapped", None)
        return self.__dict__.get("_model_wrapped") if mine is None else mine

    @model_wrapped.setter
    def model_wrapped(self, model: Any) -> None:
        if threading.get_ident() == self._owner_thread:
            self.__dict__["_model_wrapped"] = model
        else:
            self._this_thread.model_wrapped = model

    def end(self) -> None:
        """Release ODC, end the generation mode (a colocated vLLM engine is shut down: before the process groups go,
        else its exit-time teardown fails on every rank), then finish the trackers and destroy the process group (if
        the engine has not). Collective: call it once, on every rank, at the end."""
        self._prefetch.close(self.odc.plugin.timeout)
        self.close_odc()
        self._generator.end()
        self.accelerator.end_training()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The shared ``train``; a generation batch still decoding ahead at its end is waited for, within the ODC
        timeout, and dropped; on a failure (a dead peer among them) it is dropped at once, its daemon thread left to
        end with the process, so that the error is raised within the timeout."""
        try:
            result = super().train(*args, **kwargs)
        except BaseException:
            self._prefetch.close(0.0)
            raise
        self._prefetch.close(self.odc.plugin.timeout)
        return result

    # -- the hooks a rollout trainer supplies -------------------------------------------------------------------------

    def _deferred_passes(self, scored: dict[str, Any]) -> list[Pass]:
        """The deferred log-probability passes the loss needs, given TRL's scored output: ``(model, runtime, context,
        key)`` each (``context`` the one to run ``model`` in: :func:`~hf_odc.trainer.core._reference.reference_of`'s for
        a reference), run on every packed microbatch of the generation batch and stored under ``key`` in its loss
        inputs."""
        raise NotImplementedError

    def _after_scoring(self, rollouts: Rollouts, planned: list[RolloutStep]) -> None:
        """After the deferred passes, with the gathered generation batch and this rank's planned steps."""

    def _steps_per_generation(self) -> int:
        """Calls of ``training_step`` one generation batch serves per iteration (TRL's ``steps_per_generation``)."""
        return self.args.steps_per_generation

    def _iterations_per_generation(self) -> int:
        """How many times each generation batch is trained on (TRL's ``num_iterations``)."""
        return self.num_iterations

    # -- rollouts -----------------------------------------------------------------------------------------------------

    def _generate(self, prompts: list) -> tuple:
        """TRL's, inside the generation mode's :meth:`~hf_odc.trainer.generation.modes.Generator.generation_batch`,
        recording each completion's true length (TRL pads them to the longest). A batch decoding ahead is waited for
        first: the refresh writes the copy it decodes on."""
        self._prefetch.wait()
        with self._generator.generation_batch():
            result = super()._generate(prompts)
        self._completion_lengths = [len(ids) for ids in result[1]]
        return result

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> tuple:
        """TRL's, decoded on this rank alone in the run's generation mode, or by vLLM. With tools, the turns' decoding
        context (one forward-only ODC minibatch, or the gathered weights) is entered at the first turn and held
        through TRL's tool loop (:meth:`_tool_call_loop`), so that each rank decodes as many turns as its own
        completions need, alone, and meets the others once per generation batch. With ``max_rollout_staleness=1``, the
        turn decoded ahead for these very arguments is taken instead (:meth:`_decode_ahead`)."""
        ahead = self._prefetch.take((args, kwargs))
        if ahead is not None:
            result, self._behaviour_logps = ahead
            return result
        self._generator.hold_turns()
        try:
            return super()._generate_single_turn(*args, **kwargs)
        except BaseException:
            self._generator.release_turns()
            raise
        finally:
            if not getattr(self, "tools", None):
                self._generator.release_turns()

    def _tool_call_loop(self, *args: Any, **kwargs: Any) -> tuple:
        """TRL's tool loop (run the tools, decode the next turn of the completions that called one), inside the
        decoding context its first turn entered; left at its end."""
        try:
            return super()._tool_call_loop(*args, **kwargs)
        finally:
            self._generator.release_turns()

    def _get_per_token_logps_and_entropies(self, model: nn.Module, input_ids: torch.Tensor, *args: Any, **kwargs: Any):
        """TRL's, except while a training generation batch is scored: then the old/reference passes are deferred to
        :meth:`_score_rollouts` (packed, balanced, one-sided), and a placeholder of the right shape is returned."""
        if not self._deferring_scores:
            return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)
        logits_to_keep = kwargs.get("logits_to_keep", args[1] if len(args) > 1 else None)
        return input_ids.new_zeros((input_ids.size(0), logits_to_keep), dtype=torch.float32), None, None

    @contextlib.contextmanager
    def _deferred_scoring(self) -> Iterator[None]:
        self._deferring_scores = True
        try:
            yield
        finally:
            self._deferring_scores = False

    def _plan_step(self, window: list[Any]) -> RolloutStep:
        """This optimizer step's :class:`~hf_odc.trainer.online.rollouts.RolloutStep`: generating, scoring and planning
        a new generation batch when TRL would (every ``steps_per_generation * num_iterations`` calls of
        ``training_step``), then taking its next minibatch. ``window`` holds each accumulation call's prompts (TRL
        repeats the generation batch's prompts for each call)."""
        first, self._step = self._step, self._step + len(window)  # TRL counts calls of training_step
        per_generation = self._steps_per_generation()
        if first % (per_generation * self._iterations_per_generation()) == 0 or self._buffered_inputs is None:
            with self.odc.bounded("generation and scoring"):
                self._buffered_inputs = self._generate_and_plan(window[0])
            if self.args.max_rollout_staleness:
                self._decode_ahead()
        return self._buffered_inputs[(first % per_generation) // self.args.gradient_accumulation_steps]

    # -- max_rollout_staleness=1 --------------------------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device) -> tuple:
        """The Trainer's, reading ahead with ``max_rollout_staleness=1`` until the next generation batch's prompts are
        held (:class:`~hf_odc.trainer.online._overlap.Lookahead`: the loop still takes every item in order)."""
        if not self.args.max_rollout_staleness:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._lookahead.source is not epoch_iterator:  # a new epoch: nothing of the last one is left ahead
            self._lookahead = Lookahead(epoch_iterator)
        samples = super().get_batch_samples(self._lookahead, num_batches, device)
        self._lookahead.fill(self._calls_per_generation() - self.args.gradient_accumulation_steps + 1)
        return samples

    def _calls_per_generation(self) -> int:
        """Calls of ``training_step`` one generation batch serves (TRL's ``steps_per_generation * num_iterations``)."""
        return self._steps_per_generation() * self._iterations_per_generation()

    def _decode_ahead(self) -> None:
        """After a generation batch's rollouts are in, the copy refreshed to the weights this batch trains from: start
        decoding the next batch's prompts, read ahead from the loader, in a background thread on the copy
        (:meth:`~hf_odc.trainer.generation.modes.StaticGenerator.ahead`), their behaviour log-probabilities scored there
        too; nothing when the run ends first or this epoch's loader holds no next batch."""
        steps = self._calls_per_generation() // self.args.gradient_accumulation_steps
        following = self._lookahead.peek(self._calls_per_generation() - self.args.gradient_accumulation_steps)
        if following is None or self.state.global_step + steps >= self.state.max_steps:
            return
        prompt_ids, images, multimodal_fields = _compat.tokenized_prompts(
            self, copy.deepcopy([x["prompt"] for x in following])
        )
        args = self._single_turn_arguments(prompt_ids, images, multimodal_fields)
        context, temperature = self._generator.ahead(), self.args.temperature
        parent, seed = super(), self.args.seed + self._generation_index

        def decode() -> tuple[Any, list[torch.Tensor]]:
            torch.manual_seed(seed)  # a reproducible run where the update draws no random numbers meanwhile
            decoder = self._generator.decoder
            with context, recording_log_probs(decoder, temperature):
                result = parent._generate_single_turn(*args)
                completion_ids = result[0] if isinstance(result, tuple) else result
                logps = behaviour_log_probs(decoder, prompt_ids, completion_ids, temperature)
            return result, logps

        self._prefetch.start((args, {}), decode)

    def _single_turn_arguments(self, prompt_ids: list, images: Any, multimodal_fields: dict) -> tuple:
        """The positional arguments TRL's ``_generate`` passes its ``_generate_single_turn`` in training."""
        return (prompt_ids, images, multimodal_fields)

    def _generate_and_plan(self, generation_batch: list[dict[str, Any]]) -> list[RolloutStep]:
        """Generate and score with TRL, gather the rollouts, plan every minibatch of the generation batch, pack this
        rank's microbatches and run the deferred passes on them."""
        args, metrics = self.args, self._metrics["train"]
        started = time.perf_counter()
        # TRL's unwrap_model_for_generation and disable_gradient_checkpointing read a deprecated property (_quiet)
        with self._deferred_scoring(), without_checkpointing_alias_warning():
            scored = self._generate_and_score_completions(generation_batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        metrics["generation_s"].append(time.perf_counter() - started)
        local = Rollouts.from_scored(scored, self._completion_lengths)
        behaviour, self._behaviour_logps = self._behaviour_logps, None
        if args.max_rollout_staleness:
            metrics["rollout_staleness"].append(float(behaviour is not None))
        if behaviour is not None:  # decoded ahead: the policy that sampled it is one batch older than this one
            local.sampling_logps = [logps[:n] for logps, n in zip(behaviour, self._completion_lengths, strict=True)]
        if self._rope_index is not None:
            local.images = rollout_images(scored, local.prompt_ids, local.completion_ids, self._rope_index)
        rollouts = gather_rollouts(local)
        planned = plan_generation_batch(
            rollouts,
            steps=self._steps_per_generation() // args.gradient_accumulation_steps,
            rank=self.accelerator.process_index,
            seed=args.seed + self._generation_index,
            planner=self._planner,
            max_tokens_for=args.max_tokens_for,
            sequence_group=self.odc.sequence_group,
        )
        self._generation_index += 1
        microbatches = [microbatch for step in planned for microbatch in step.microbatches]
        passes = self._deferred_passes(scored)
        if behaviour is not None:  # the ratio against the behaviour policy, in place of the current one's pass
            passes = [p for p in passes if p[3] != "old_logps"]
            for microbatch in microbatches:
                microbatch["loss"]["old_logps"] = microbatch["loss"]["sampling_logps"]
        if passes:  # every rank warms the generation batch's lengths, so none plans them inside a pass
            lengths = [length for step in planned for length in step.attended_lengths()]
            self._warm_attention(lengths, forward_only=[p[0] for p in passes])
            metrics["scoring_s"].append(sum(self._score_rollouts(*p[:3], microbatches, p[3]) for p in passes))
        self._after_scoring(rollouts, planned)
        return planned

    def _score_rollouts(
        self,
        model: nn.Module,
        runtime: ODCRuntime,
        context: contextlib.AbstractContextManager,
        microbatches: list[dict[str, Any]],
        key: str,
        output: str = "log_probs",
    ) -> float:
        """Per-token log-probabilities (or another per-position ``output`` of the forward, e.g. ``"entropy"``) of
        ``model``, run in ``context``, at the completion tokens of this rank's packed microbatches, stored under
        ``key`` in each one's loss inputs, in one forward-only minibatch; returns its device-timed span (seconds)."""

        def store(microbatch: dict[str, Any], inputs: dict[str, Any], outputs: Any) -> None:
            microbatch["loss"][key] = getattr(outputs, output)[0][inputs["loss"]["token_index"]].float()

        return self._forward_only(model, runtime, microbatches, store, (context,))


def _drops_out(model: nn.Module) -> bool:
    """Whether ``model`` draws dropout masks in training: a dropout module with a positive rate, or attention dropout
    (transformers applies it inside the attention function, from the config)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config.get_text_config(), "attention_dropout", 0.0):
        return True
    return any(isinstance(module, nn.Dropout) and module.p > 0 for module in model.modules())

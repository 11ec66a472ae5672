"""Every use of FSDP2's private state, in one place.

FSDP2's public extension points (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) let ODC replace the two
collectives, but a custom comm is told neither which parameters it serves nor how FSDP laid them out. ODC needs both
to publish each shard where peers can read it and to route pushed gradient pieces back to the right ``.grad``. So this
module reads, and nothing else does:

* ``FSDPModule._get_fsdp_state()`` and the state's parameter group(s) (``_fsdp_param_groups`` in torch 2.13, a single
  ``_fsdp_param_group`` in 2.11);
* per group: ``fsdp_params``, ``mesh_info`` (with HSDP, its ``replicate_process_group``), ``post_forward_mesh_info``
  (read for the layout, and cleared while :func:`held_unsharded` keeps a model unsharded for decoding),
  ``gradient_divide_factor``, ``force_sum_reduction_for_comms``, ``_partial_reduce_output`` (where HSDP keeps gradients
  it has not all-reduced yet) and the ``mp_policy`` (the group's up to torch 2.14, each parameter's from 2.15,
  when FSDP2 also began reducing in each parameter's ``grad_dtype``);
* per parameter: ``sharded_param``, ``sharded_size``, ``padded_sharded_param_size``, ``fsdp_placement``,
  ``offload_to_cpu`` and whether its local shard has an all-gather extension (``fsdp_pre_all_gather``);
* the comm interfaces ``AllGather`` / ``ReduceScatter``, which ``set_custom_*`` take but torch does not export;
* ``_get_gradient_divide_factors``, so that ODC's gradients follow FSDP's own divide-factor rules exactly.

Each of these is checked where it is read (:func:`hf_odc._torch_support.require`), so a torch that changed one
fails with an error naming it rather than computing wrong gradients; the versions the suite ran on are in
:data:`hf_odc._torch_support.CHECKED_TORCH`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard

from .._torch_support import UnsupportedTorchError, check_torch_version, require

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError as e:  # pragma: no cover - a torch that moved FSDP2's comm interfaces
    raise UnsupportedTorchError(f"hf_odc needs FSDP2's AllGather / ReduceScatter comm interfaces: {e}") from e

__all__ = [
    "AllGather",
    "GroupSpec",
    "ParamSpec",
    "ReduceScatter",
    "check_fsdp_layout",
    "check_torch_version",
    "describe_groups",
    "gradient_divisor",
    "held_unsharded",
    "install_comms",
    "lazy_init_root",
    "set_replica_all_reduce",
    "take_unreduced_gradient",
]

_GROUP_ATTRS = (
    "fsdp_params",
    "mesh_info",
    "post_forward_mesh_info",
    "gradient_divide_factor",
    "force_sum_reduction_for_comms",
)
_PARAM_ATTRS = (
    "sharded_param",
    "sharded_size",
    "padded_sharded_param_size",
    "fsdp_placement",
    "offload_to_cpu",
    "_sharded_local_tensor",
)


def check_fsdp_layout() -> None:
    """The version floor, and what can be checked before any model exists: FSDP2's public comm setters, its state
    accessor, and the divide-factor helper with the arguments ODC passes."""
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    check_torch_version()
    require(FSDPModule, ("_get_fsdp_state", "set_custom_all_gather", "set_custom_reduce_scatter"), "FSDPModule")
    require(_fsdp_collectives, ("_get_gradient_divide_factors",), "torch.distributed.fsdp._fully_shard")
    parameters = inspect.signature(_fsdp_collectives._get_gradient_divide_factors).parameters
    if len(parameters) != 6:
        raise UnsupportedTorchError(
            "hf_odc calls FSDP2's _get_gradient_divide_factors with 6 arguments, but this torch's takes "
            f"{list(parameters)}; this torch changed how FSDP2 divides gradients."
        )


@dataclass(frozen=True)
class ParamSpec:
    """One FSDP-managed parameter, as laid out in its group's all-gather input and reduce-scatter chunks.

    Attributes:
        param: the sharded parameter (a DTensor ``nn.Parameter``, ``Shard(0)`` over the group).
        fqn: its name in the model (the first name, for a tied parameter).
        sharded_size: this rank's unpadded local shard shape.
        padded_numel: the padded shard's numel; every rank's slot for this parameter has this size.
    """

    param: nn.Parameter
    fqn: str
    sharded_size: torch.Size
    padded_numel: int

    @property
    def sharded_numel(self) -> int:
        return math.prod(self.sharded_size)

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad


@dataclass(frozen=True)
class GroupSpec:
    """One FSDP parameter group (the parameters of one ``fully_shard`` call), with what ODC needs to know of it.

    ``process_group`` is the shard group (the ranks ODC reads from and pushes to); ``replicate_group``, with HSDP's 2-D
    mesh, the ranks holding the same shard on the other hosts (``None`` on a 1-D mesh).
    """

    fqn: str
    params: tuple[ParamSpec, ...]
    gather_dtype: torch.dtype
    reduce_dtype: torch.dtype
    process_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    module: FSDPModule
    handle: object  # the FSDPParamGroup, opaque outside this module

    @property
    def gather_numel(self) -> int:
        """Elements per rank in the all-gather (every parameter's padded shard)."""
        return sum(p.padded_numel for p in self.params)

    @property
    def grad_numel(self) -> int:
        """Elements per rank in the reduce-scatter (the trainable parameters' padded shards)."""
        return sum(p.padded_numel for p in self.params if p.trainable)


def _param_groups(module: FSDPModule) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch 2.11: at most one group per module
        require(state, ("_fsdp_param_group",), "FSDPState")
        group = state._fsdp_param_group
        groups = [] if group is None else [group]
    for group in groups:
        require(group, _GROUP_ATTRS, "FSDPParamGroup")
        for fsdp_param in group.fsdp_params:
            require(fsdp_param, _PARAM_ATTRS, "FSDPParam")
            if not _per_parameter_policy(group):
                continue
            require(fsdp_param, ("mp_policy",), "FSDPParam")
            require(fsdp_param.sharded_param, ("grad_dtype",), "FSDP's sharded parameter")
    return list(groups)


def _per_parameter_policy(group) -> bool:
    """Whether this FSDP2 keeps a mixed-precision policy per parameter (torch 2.15 on) rather than per group; with
    it, a gradient is reduced in its parameter's ``grad_dtype`` when the policy sets no ``reduce_dtype``."""
    return not hasattr(group, "mp_policy")


def _policy(group, fsdp_param):
    return fsdp_param.mp_policy if _per_parameter_policy(group) else group.mp_policy


def _gather_dtype(group, fqn: str) -> torch.dtype:
    """The dtype FSDP all-gathers in: ``mp_policy.param_dtype`` for floating parameters, else their own dtype."""
    dtypes = set()
    for fsdp_param in group.fsdp_params:
        param_dtype = _policy(group, fsdp_param).param_dtype
        orig = fsdp_param.sharded_param.dtype
        dtypes.add(param_dtype if param_dtype is not None and orig.is_floating_point else orig)
    if len(dtypes) != 1:
        raise ValueError(
            f"hf_odc: the FSDP group {fqn!r} all-gathers parameters of several dtypes {sorted(map(str, dtypes))}; "
            "ODC needs one dtype per fully_shard call. Cast the module's parameters to one dtype first."
        )
    return dtypes.pop()


def _reduce_dtype(group, fqn: str, gather_dtype: torch.dtype) -> torch.dtype:
    """The dtype FSDP reduce-scatters the group's gradients in: ``mp_policy.reduce_dtype`` if set, else the compute
    (= gather) dtype, or, with per-parameter policies, each parameter's ``grad_dtype``. One per group."""
    per_parameter = _per_parameter_policy(group)
    dtypes = set()
    for fsdp_param in group.fsdp_params:
        if not fsdp_param.sharded_param.requires_grad:
            continue
        reduce = _policy(group, fsdp_param).reduce_dtype
        if reduce is None:
            reduce = fsdp_param.sharded_param.grad_dtype if per_parameter else gather_dtype
        dtypes.add(reduce)
    if len(dtypes) > 1 or None in dtypes:
        # Per-parameter grad_dtypes would also reorder FSDP's reduce-scatter input by dtype.
        raise ValueError(
            f"hf_odc: the FSDP group {fqn!r} reduces gradients in {sorted(map(str, dtypes))}; ODC needs one "
            "concrete reduce dtype per fully_shard call."
        )
    return dtypes.pop() if dtypes else gather_dtype


def _check_supported(group, fqn: str) -> None:
    if group.post_forward_mesh_info is not None and group.post_forward_mesh_info != group.mesh_info:
        raise ValueError(
            f"hf_odc: {fqn!r} reshards to a smaller mesh after forward (reshard_after_forward=<int>); ODC supports "
            "reshard_after_forward=True or False."
        )
    single = group.mesh_info.shard_process_group.size() == 1
    if single and _replicate_group(group) is not None and group.gradient_divide_factor is not None:
        raise ValueError(
            f"hf_odc: {fqn!r} sets a gradient divide factor on a one-rank shard group, where FSDP2 divides before ODC "
            "sees the gradient; keep the default factor, or shard over more ranks."
        )
    for fsdp_param in group.fsdp_params:
        if fsdp_param.offload_to_cpu:
            raise ValueError(f"hf_odc: {fqn!r} uses CPUOffloadPolicy, which ODC does not support.")
        if fsdp_param.fsdp_placement != Shard(0):
            raise ValueError(
                f"hf_odc: {fqn!r} shards a parameter on {fsdp_param.fsdp_placement}; ODC supports Shard(0) only "
                "(drop shard_placement_fn)."
            )
        if hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"):
            raise ValueError(f"hf_odc: {fqn!r} has a parameter with an FSDP all-gather extension (e.g. float8).")


def _replicate_group(group) -> dist.ProcessGroup | None:
    mesh_info = group.mesh_info
    if getattr(mesh_info, "replicate_mesh_dim", None) is None:
        return None
    require(mesh_info, ("replicate_process_group",), "FSDP's HSDPMeshInfo")
    require(group, ("_partial_reduce_output", "all_reduce_grads"), "FSDPParamGroup")
    return mesh_info.replicate_process_group


def describe_groups(model: nn.Module) -> list[GroupSpec]:
    """Every FSDP parameter group in ``model``, in module order, validated for ODC."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    specs = []
    for module_fqn, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = _param_groups(module)
        fqn = module_fqn or "<root>"
        if len(groups) > 1:
            raise ValueError(f"hf_odc: {fqn!r} has several FSDP parameter groups (per-parameter meshes); ODC needs 1.")
        for group in groups:
            _check_supported(group, fqn)
            params = tuple(
                ParamSpec(
                    param=fp.sharded_param,
                    fqn=names.get(id(fp.sharded_param), "?"),
                    sharded_size=torch.Size(fp.sharded_size),
                    padded_numel=math.prod(fp.padded_sharded_param_size),
                )
                for fp in group.fsdp_params
            )
            gather_dtype = _gather_dtype(group, fqn)
            specs.append(
                GroupSpec(
                    fqn=fqn,
                    params=params,
                    gather_dtype=gather_dtype,
                    reduce_dtype=_reduce_dtype(group, fqn, gather_dtype),
                    process_group=group.mesh_info.shard_process_group,
                    replicate_group=_replicate_group(group),
                    module=module,
                    handle=group,
                )
            )
    return specs


def lazy_init_root(model: FSDPModule) -> None:
    """FSDP2's lazy initialisation from ``model``, the root, which its first forward runs: for a call that enters the
    model below the root (a PEFT model's ``generate`` calls the wrapped model's), where the first sharded layer would
    otherwise take itself for the root."""
    state = model._get_fsdp_state()
    require(state, ("_lazy_init",), "FSDP2's root state")
    state._lazy_init()


def install_comms(spec: GroupSpec, all_gather, reduce_scatter=None) -> None:
    """Route ``spec``'s all-gather and reduce-scatter through ODC's comms, with FSDP2's public setters.

    From torch 2.13, unused trainable parameters are reduce-scattered as zeros, which keeps the reduce-scatter layout
    the same in every backward; torch 2.11 cannot, so there every trainable parameter must get a gradient. A group
    with no trainable parameter never reduce-scatters and gets no ``reduce_scatter``.
    """
    module = spec.module
    module.set_custom_all_gather(all_gather)
    if reduce_scatter is not None:
        module.set_custom_reduce_scatter(reduce_scatter)
        if hasattr(module, "set_reduce_scatter_unused_params"):  # torch >= 2.13; before, see ODCReduceScatter
            module.set_reduce_scatter_unused_params(True, recurse=False)


def gradient_divisor(spec: GroupSpec, device_type: str) -> float:
    """What FSDP divides the *sum* of the ranks' reduce-scatter inputs (over every replica too, with HSDP) by, minus
    what it already divided them by.

    FSDP may pre-divide the reduce-scatter input (fp16 overflow guard) and divides the rest after the collective,
    or lets the collective average. ODC sums raw pushes, so it divides by the remainder once, at the minibatch's end.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    group = spec.handle
    pg = spec.process_group
    replicas = spec.replicate_group
    pre, _post, _rs_op, _ar_op = _get_gradient_divide_factors(
        pg, replicas, spec.reduce_dtype, device_type, group.gradient_divide_factor, group.force_sum_reduction_for_comms
    )
    factor = group.gradient_divide_factor
    if factor is None:
        factor = float(pg.size() * (replicas.size() if replicas is not None else 1))
    return factor / (pre or 1.0)


def set_replica_all_reduce(spec: GroupSpec, enabled: bool) -> None:
    """HSDP's all-reduce across replicas after each backward on or off (FSDP2's public switch); hybrid ODC turns it
    off inside a minibatch and reduces across replicas itself, once, at the exit."""
    spec.module.set_requires_all_reduce(enabled, recurse=False)


def take_unreduced_gradient(spec: GroupSpec) -> torch.Tensor | None:
    """What HSDP accumulated for ``spec`` without all-reducing it (the all-reduce off), and forget it.

    With a shard group of one rank FSDP2 skips the reduce-scatter (ODC's push) and keeps the group's gradient
    shard here instead, summed over the backwards; with more ranks it holds ODC's all-zero sink."""
    group = spec.handle
    unreduced = group._partial_reduce_output
    group._partial_reduce_output = None
    return unreduced


@contextlib.contextmanager
def held_unsharded(model: nn.Module) -> Iterator[Callable[[], None]]:
    """Keep every FSDP group of ``model`` unsharded through any number of forwards, until the block ends.

    Yields the function that unshards them all (FSDP's public ``unshard``: call it where its all-gather should run;
    inside an ODC minibatch that is one-sided reads of the peers' shards, no collective). Meanwhile each group's
    reshard after forward is off (its ``post_forward_mesh_info`` cleared: FSDP2 reshards after a forward exactly when
    that is set), so the forwards that follow find their parameters unsharded and communicate nothing. On exit the
    settings are restored and every group is resharded, freeing the unsharded copy."""
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    groups = [group for module in modules for group in _param_groups(module)]
    saved = [group.post_forward_mesh_info for group in groups]
    for group in groups:
        group.post_forward_mesh_info = None
    try:
        yield lambda: [module.unshard() for module in modules]
    finally:
        for group, mesh_info in zip(groups, saved, strict=True):
            group.post_forward_mesh_info = mesh_info
        for module in modules:
            module.reshard()

"""The private TRL / transformers names hf_odc relies on are checked in one place (:mod:`hf_odc._compat`), and a
release that renamed one is refused naming it, instead of failing deep in a step."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import trl
from torch import nn

import hf_odc
from hf_odc import _compat
from hf_odc.trainer import ODCDPOTrainer, ODCGRPOTrainer, ODCKTOTrainer, ODCRewardTrainer, ODCSFTTrainer


def test_the_installed_libraries_have_every_listed_name():
    _compat.check_classes()


def test_every_trainer_hook_the_package_overrides_is_listed():
    """An ODC trainer overriding a private TRL/transformers hook that the check does not cover would break silently
    when the hook is renamed (the override would simply never run)."""
    listed = {name for names in _compat.CLASS_NAMES.values() for name in names}
    listed.add("_defer_fsdp_gradient_reduction")  # transformers >= 5.23 only (see _compat.CLASS_NAMES)
    for trainer in (ODCSFTTrainer, ODCGRPOTrainer, ODCDPOTrainer, ODCRewardTrainer, ODCKTOTrainer):
        ours = [cls for cls in trainer.__mro__ if cls.__module__.startswith("hf_odc")]
        theirs = [cls for cls in trainer.__mro__ if cls.__module__.split(".")[0] in ("trl", "transformers")]
        overridden = {
            name
            for cls in ours
            for name, value in vars(cls).items()
            if callable(value)
            and name.startswith("_")
            and not name.startswith("__")
            and any(name in vars(base) for base in theirs)
        }
        assert overridden, trainer  # the trainers do override private hooks: the test must see them
        assert overridden <= listed, f"{trainer.__name__} overrides unchecked hooks: {overridden - listed}"


def test_a_renamed_class_attribute_is_named(monkeypatch):
    monkeypatch.delattr(trl.GRPOTrainer, "_generate")
    with pytest.raises(_compat.UnsupportedLibraryError, match=r"trl\.GRPOTrainer's _generate, which trl \d"):
        _compat.check_classes()


def test_missing_trainer_state_is_named():
    class Stub(trl.SFTTrainer):
        def __init__(self):  # TRL's __init__ not run: none of its state exists
            pass

    with pytest.raises(_compat.UnsupportedLibraryError, match="_total_train_tokens"):
        _compat.check_trainer(Stub())


def test_a_sharded_model_is_marked_fsdp_managed_for_transformers():
    from transformers.distributed.fsdp import is_fsdp_managed_module

    model = nn.Linear(2, 2)
    _compat.mark_fsdp_managed(model)
    assert is_fsdp_managed_module(model)


def test_a_transformers_that_ignores_the_mark_is_refused(monkeypatch):
    import transformers.distributed.fsdp as fsdp

    monkeypatch.setattr(fsdp, "is_fsdp_managed_module", lambda module: False)
    with pytest.raises(_compat.UnsupportedLibraryError, match="_is_fsdp_managed_module"):
        _compat.mark_fsdp_managed(nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("dropped", "call"),
    [
        (("transformers", "PreTrainedModel", "_from_config"), lambda: _compat.model_from_config(nn.Module, None)),
        (("transformers", "PreTrainedModel", "_no_split_modules"), lambda: _compat.no_split_modules(nn.Linear(2, 2))),
        (("transformers", "PretrainedConfig", "_attn_implementation"), lambda: _compat.attn_implementation(None)),
        (
            ("transformers", "GenerationMixin", "_get_logits_processor"),
            lambda: _compat.generation_setup(nn.Linear(2, 2), None, {}),
        ),
        (
            ("trl.trainer.sft_trainer", None, "DataCollatorForLanguageModeling"),
            lambda: _compat.padding_free_collator(0),
        ),
        (("trl.trainer.grpo_trainer", None, "logger"), lambda: _compat.library_logger("trl.trainer.grpo_trainer")),
        (("torch.distributed.distributed_c10d", None, "_get_default_store"), _compat.default_store),
        (("torch.distributed.distributed_c10d", None, "_world"), _compat.process_groups),
        (("torch.distributed._symmetric_memory", None, "rendezvous"), _compat.symmetric_memory),
    ],
    ids=lambda value: value[-1] if isinstance(value, tuple) else "",
)
def test_a_renamed_private_name_is_named_where_it_is_read(monkeypatch, dropped, call):
    module, cls, name = dropped
    owner = importlib.import_module(module)
    monkeypatch.delattr(getattr(owner, cls) if cls else owner, name)
    with pytest.raises(_compat.UnsupportedLibraryError, match=rf"relies on {module}.*{name}, which \w+ \d"):
        call()


def test_the_attention_operators_are_checked(monkeypatch):
    """What activation checkpointing saves of the attention (hf_odc.trainer.core.attention): SDPA's fused operators, and
    varlen_attn's custom operator; an SDPA operator a release renamed is named, not silently recomputed."""
    import torch

    operators = _compat.attention_operators()
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in operators
    assert torch.ops.torch_attn._varlen_attn.default in operators
    monkeypatch.setattr(_compat, "SDPA_OPERATORS", (*_compat.SDPA_OPERATORS, "_scaled_dot_product_renamed"))
    with pytest.raises(
        _compat.UnsupportedLibraryError, match=r"torch\.ops\.aten's _scaled_dot_product_renamed, which torch"
    ):
        _compat.attention_operators()


def test_a_trainer_without_the_distributed_loading_flag_is_refused():
    class Stub(trl.SFTTrainer):
        def __init__(self):  # transformers' Trainer.__init__, which sets the flag, not run
            pass

    with pytest.raises(_compat.UnsupportedLibraryError, match="is_distributed_loading_by_transformers"):
        _compat.mark_distributed_loading(Stub())


def test_the_process_groups_and_their_timeout(monkeypatch):
    """The job's process groups (what the liveness checks bound), and the timeout set on them through torch's public
    setter or, before torch 2.14, its private one."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        assert {dist.group.WORLD, group} <= set(_compat.process_groups())
        _compat.set_group_timeout(group, timedelta(seconds=7))
        monkeypatch.delattr(dist, "set_timeout", raising=False)  # as before torch 2.14
        _compat.set_group_timeout(group, timedelta(seconds=8))
        monkeypatch.delattr(dist.distributed_c10d, "_set_pg_timeout")
        with pytest.raises(_compat.UnsupportedLibraryError, match="_set_pg_timeout"):
            _compat.set_group_timeout(group, timedelta(seconds=9))
    finally:
        dist.destroy_process_group()


# -- no private name of these libraries outside the places that check it -----------------------------------------------

_LIBRARIES = {"torch", "transformers", "trl", "accelerate", "peft", "vllm"}
_PACKAGE = Path(hf_odc.__file__).parent
_CHECKED_PLACES = {"_compat.py", "engine/_fsdp_internals.py"}
"""Where hf_odc reads other libraries' private names, each checked before use: everything but FSDP2's parameter-group
state in :mod:`hf_odc._compat`, that state in the engine's :mod:`hf_odc.engine._fsdp_internals`."""
_STANDARD_LIBRARY = {"_actions"}  # argparse.ArgumentParser's, read by the demo script's parser (a TrlParser)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _trees() -> dict[str, ast.Module]:
    return {path.relative_to(_PACKAGE).as_posix(): ast.parse(path.read_text()) for path in _PACKAGE.rglob("*.py")}


def _own_names(trees: Iterable[ast.Module]) -> set[str]:
    """The private names hf_odc defines: functions, classes, variables, arguments, names imported from hf_odc and
    attributes it sets on ``self``/``cls``."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.ImportFrom) and (node.level or node.module.split(".")[0] == "hf_odc"):
                own.update(alias.asname or alias.name for alias in node.names)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                own.add(node.attr)
    return {name for name in own if _private(name)}


def _attributes(tree: ast.Module) -> Iterator[tuple[ast.AST, ast.expr, str]]:
    """Every ``obj._name`` of ``tree`` and every ``getattr``/``hasattr``/``setattr``/``delattr(obj, "_name")``:
    ``(node, obj, name)``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            yield node, node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            yield node, node.args[0], node.args[1].value


def _private_accesses(path: str, tree: ast.Module, own: set[str], checked: set[str], known: set[str]) -> list[str]:
    """What ``tree`` reads of another library's private names:

    * importing a private module or name of one of :data:`_LIBRARIES` (``from torch.x._y import z``);
    * ``m._name`` where ``m`` is (an attribute of) a module or object imported from one of them (``dist.c10d._world``);
    * ``obj._name`` on any other object, where ``_name`` is one that the checked places read (``known``) or one that
      hf_odc does not define (``own``): an object's type cannot always be told, so these stand for "another library's";
    * ``self._name`` or ``super()._name`` that hf_odc does not define.

    The names :mod:`hf_odc._compat` checks on TRL's and transformers' classes when :mod:`hf_odc.trainer` is imported
    and on a trainer when it is built (``checked``: hooks and state) are allowed everywhere.
    """
    imported = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                imported[alias.asname or root] = root
                if root in _LIBRARIES and any(map(_private, alias.name.split("."))):
                    found.append(f"{path}:{node.lineno} import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            root = node.module.split(".")[0]
            for alias in node.names:
                imported[alias.asname or alias.name] = root
            if root in _LIBRARIES and any(map(_private, [*node.module.split("."), *(a.name for a in node.names)])):
                found.append(f"{path}:{node.lineno} from {node.module} import {', '.join(a.name for a in node.names)}")
    for node, obj, name in _attributes(tree):
        base = obj
        while isinstance(base, ast.Attribute):
            base = base.value
        if isinstance(base, ast.Name) and base.id in imported:
            private = imported[base.id] in _LIBRARIES
        elif (isinstance(obj, ast.Name) and obj.id == "self") or (
            isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and obj.func.id == "super"
        ):
            private = name not in own | checked | _STANDARD_LIBRARY
        else:
            private = name not in checked and (name in known or name not in own)
        if private:
            found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_private_name_of_another_library_is_read_outside_the_checked_places():
    """A private name of torch, transformers, TRL, Accelerate, PEFT or vLLM read anywhere but :mod:`hf_odc._compat`
    (and FSDP2's state in :mod:`hf_odc.engine._fsdp_internals`) would go unchecked: a release renaming it would fail
    deep in a step, or silently."""
    trees = _trees()
    own = _own_names(trees.values())
    checked = {name for names in (*_compat.CLASS_NAMES.values(), *_compat.INSTANCE_NAMES.values()) for name in names}
    known = {name for place in _CHECKED_PLACES for _, _, name in _attributes(trees[place])}
    assert {"_attn_implementation", "_from_config", "_no_split_modules", "_get_default_store", "_world"} <= known
    found = []
    for path, tree in trees.items():
        if path in _CHECKED_PLACES:
            continue
        accesses = _private_accesses(path, tree, own, checked, known)
        found += accesses
    assert not found, "private names read outside hf_odc/_compat.py (move them there, checked):\n" + "\n".join(found)

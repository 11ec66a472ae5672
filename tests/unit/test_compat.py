"""The private TRL / transformers names hf_odc relies on are checked in one place (:mod:`hf_odc._compat`), and a
release that renamed one is refused naming it, instead of failing deep in a step."""

from __future__ import annotations

import pytest
import trl
from torch import nn

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

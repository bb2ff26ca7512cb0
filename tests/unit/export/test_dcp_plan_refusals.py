"""The DCP export's refusals, one rule each, on hand-made plans (no torch): an optimizer state that is not
Adam's, or not located, is refused with CK402 naming the checkpoint's kind, before anything is written
(``export/dcp.plan_dcp``; the real kinds are in tests/export/test_dcp_kinds.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptspec.deepspeed.kinds import Kind
from ckptspec.errors import ReconstructUnsupported
from ckptspec.export.checkpoint import Checkpoint
from ckptspec.export.dcp import plan_dcp
from ckptspec.export.model_plan import ModelPlan, TensorSource
from ckptspec.export.optimizer_state import OptimizerStatePlan


class _Plan(ModelPlan):
    def __init__(self, state: OptimizerStatePlan | Exception):
        weight = TensorSource("w", (2,), "float32", [], "trainable")
        super().__init__(Path("tag"), {"w": weight}, {}, ["w"])
        self._state = state

    def optimizer_state_plan(self) -> OptimizerStatePlan:
        if isinstance(self._state, Exception):
            raise self._state
        return self._state


def _checkpoint(kind: Kind, state: OptimizerStatePlan | Exception) -> Checkpoint:
    return Checkpoint("ckpt", kind, None, _Plan(state), [])  # type: ignore[arg-type]


def test_a_state_that_is_not_adams_is_refused_naming_the_kind():
    momentum = TensorSource("w.momentum_buffer", (2,), "float32", [], "state")
    state = OptimizerStatePlan({"w.momentum_buffer": momentum}, {"w": {"momentum_buffer": "w.momentum_buffer"}}, {})
    with pytest.raises(ReconstructUnsupported) as refused:
        plan_dcp(_checkpoint(Kind.MOE, state))
    assert refused.value.code == "CK402"
    assert refused.value.message == (
        "the MoE checkpoint's optimizer state has the keys ['momentum_buffer'], not Adam's (exp_avg, exp_avg_sq)"
    )


def test_a_state_that_is_not_located_is_refused_naming_the_kind():
    missing = ReconstructUnsupported("the optimizer state is not located", "reconstruct the weights", "uc")
    with pytest.raises(ReconstructUnsupported) as refused:
        plan_dcp(_checkpoint(Kind.UNIVERSAL, missing))
    assert refused.value.code == "CK402" and refused.value.file == "uc"
    assert refused.value.message == (
        "the optimizer state is not located (the DCP export of a universal checkpoint needs its Adam state)"
    )
    assert refused.value.hint == "reconstruct the weights"

"""One ``Kind`` vocabulary: a tag directory's kind from its file names, a live engine's from its attributes.

The real checkpoints of every kind go through ``kind_of_dir`` in the producer and validation tests
(``describe.describe_tag_dir`` dispatches on it); these pin the vocabulary itself, without
DeepSpeed: which names make which kind, and that the engine and directory sides agree.
"""

from __future__ import annotations

import pytest

from ckptspec.deepspeed.kinds import Kind, kind_of_dir, kind_of_engine, needs_index

ZERO = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]


@pytest.mark.parametrize(
    ("names", "kind"),
    [
        (ZERO, Kind.ZERO),
        (["mp_rank_00_model_states.pt"], Kind.STAGE0),
        ([*ZERO, "mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"], Kind.MODEL_PARALLEL),
        ([*ZERO, "layer_01_expert_0_mp_rank_00_model_states.pt"], Kind.MOE),
        (["mp_rank_00_model_states.pt", "expp_rank_0_mp_rank_00_optim_states.pt"], Kind.MOE),
        (["mp_rank_00_model_states.pt", "zero/"], Kind.UNIVERSAL),
        (["layer_01-model_00-model_states.pt"], Kind.MODEL_PARALLEL),  # no model states: not a stage-0 pipeline
    ],
    ids=lambda v: v.value if isinstance(v, Kind) else None,
)
def test_kind_of_dir(tmp_path, names, kind):
    for name in names:
        if name.endswith("/"):
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_bytes(b"")
    assert kind_of_dir(tmp_path) is kind
    assert needs_index(tmp_path) is kind.needs_index


def _engine(cls="DeepSpeedEngine", stage=2, moe=False, mp=1):
    return type(cls, (), {"has_moe_layers": moe, "mp_world_size": mp, "zero_optimization_stage": lambda self: stage})()


@pytest.mark.parametrize(
    ("engine", "kind"),
    [
        (_engine(), Kind.ZERO),
        (_engine(stage=0), Kind.STAGE0),
        (_engine(moe=True), Kind.MOE),
        (_engine("PipelineEngine", stage=0), Kind.PIPELINE_STAGE0),
        (_engine("PipelineEngine", stage=1), Kind.MODEL_PARALLEL),
        (_engine(mp=2), Kind.MODEL_PARALLEL),
    ],
    ids=lambda v: v.value if isinstance(v, Kind) else None,
)
def test_kind_of_engine(engine, kind):
    assert kind_of_engine(engine) is kind
    assert kind.masters_kind == (kind.value if kind in (Kind.MOE, Kind.STAGE0, Kind.PIPELINE_STAGE0) else None)

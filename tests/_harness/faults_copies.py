"""A stored copy of the weights taken from another run (#39, item 5), in the style of ``faults.py``
(whose ``FAULTS`` includes these): a model-states, layer or expert file of a harness checkpoint of the
same model trained with another dtype, stage or data put in place of the checkpoint's own, under its name.
Every other check passes (same names, shapes, flat offsets, sizes; counters of the same step); only its
values, or its dtype, tell it from the masters. ckptspec must report CK235 naming the file, through
validate (without hashes), reconstruct, load_state_dict and inspect.

``COPIES_FAULTS`` are plain ZeRO checkpoints (a manifest 1.x); ``COPIES_INDEX_FAULTS`` the kinds a
checkpoint index describes (pipeline, AutoTP, MoE, stage 0)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from .faults import Fault, FaultEnv, _edit, tag_dir


def _from_donor(*names: str) -> Callable[[Path, FaultEnv], None]:
    """The mutation copying the donor's files ``names`` over the checkpoint's own."""

    def mutate(save_dir: Path, env: FaultEnv) -> None:
        assert env.donor is not None
        for name in names:
            target = tag_dir(save_dir) / name
            assert target.is_file(), target
            shutil.copyfile(tag_dir(env.donor) / name, target)

    mutate.__doc__ = f"{', '.join(names)} of the donor's save in place of the checkpoint's"
    return mutate


def module_of_donor(save_dir: Path, env: FaultEnv) -> None:
    """Stage 0 keeps masters and module in one file: only the module (every weight) of the donor's."""
    import torch

    assert env.donor is not None
    name = "mp_rank_00_model_states.pt"
    donor = torch.load(tag_dir(env.donor) / name, map_location="cpu", weights_only=False)["module"]
    _edit(tag_dir(save_dir) / name, lambda state: state.__setitem__("module", donor))


MODEL = "mp_rank_00_model_states.pt"
S3_MODELS = ("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt")

COPIES_FAULTS = [
    Fault(
        "module-of-another-dtype-s1-bf16",
        "s1-bf16-ws2",
        "stage 1 bf16: the model states (the flat bf16 weights) of the same model trained in fp16",
        "CK235",
        MODEL,
        _from_donor(MODEL),
        donor="s1-fp16-ws2",
    ),
    Fault(
        "module-of-another-dtype-s1-fp16",
        "s1-fp16-ws2",
        "stage 1 fp16: the model states of the same model trained in bf16",
        "CK235",
        MODEL,
        _from_donor(MODEL),
        donor="s1-bf16-ws2",
    ),
    Fault(
        "module-of-another-dtype-s2-fp16",
        "s2-fp16-ws2-groups",
        "stage 2 fp16, two groups: the model states of the same model and groups trained in bf16",
        "CK235",
        MODEL,
        _from_donor(MODEL),
        donor="dcp-s2-bf16-ws2-groups",
    ),
    Fault(
        "module-of-another-run-s1-fp32",
        "s1-fp32-ws3-rr",
        "stage 1 fp32, round robin, 3 ranks: the model states of another fp32 run of the same layout (another seed)",
        "CK235",
        MODEL,
        _from_donor(MODEL),
        donor="s1-fp32-ws3-rr-seed2",
    ),
    Fault(
        "module-of-another-dtype-s3",
        "dcp-s3-bf16-ws2-groups",
        "stage 3 bf16: both ranks' model states (empty fp32 placeholders for the parameters) of the same model "
        "trained in fp32",
        "CK235",
        S3_MODELS[0],
        _from_donor(*S3_MODELS),
        donor="dcp-s3-fp32-ws2-groups",
    ),
]

COPIES_INDEX_FAULTS = [
    Fault(
        "layer-file-of-another-dtype",
        "pp2-s1-bf16-ws2",
        "pipeline pp2 bf16: layer_02 (a Block) of the same pipeline trained in fp32",
        "CK235",
        "layer_02-model_states.pt",
        _from_donor("layer_02-model_states.pt"),
        donor="pp2-s1-fp32-ws2",
    ),
    Fault(
        "layer-file-of-another-run",
        "pp2dp2-s1-bf16-ws4",
        "pipeline pp2 x dp2 bf16: layer_02 of the pp2 bf16 run (same model, other data)",
        "CK235",
        "layer_02-model_states.pt",
        _from_donor("layer_02-model_states.pt"),
        donor="pp2-s1-bf16-ws2",
    ),
    Fault(
        "layer-file-of-another-run-stage0",
        "pp2-s0-bf16-ws2",
        "pipeline pp2 at stage 0 (BF16_Optimizer): layer_03 of the pp2 x dp2 ZeRO-1 bf16 run (other data)",
        "CK235",
        "layer_03-model_states.pt",
        _from_donor("layer_03-model_states.pt"),
        donor="pp2dp2-s1-bf16-ws4",
    ),
    Fault(
        "tp-module-of-another-run",
        "tp2-s1-fp32-ws2",
        "AutoTP tp2 fp32: tensor rank 1's model states of the tp2 x dp2 bf16 run",
        "CK235",
        "mp_rank_01_model_states.pt",
        _from_donor("mp_rank_01_model_states.pt"),
        donor="tp2dp2-s2-bf16-ws4",
    ),
    Fault(
        "expert-file-of-another-dtype",
        "moe-ep2-s1-bf16-ws2",
        "MoE ep2 stage 1 bf16: expert 1's file of the same model trained in fp32",
        "CK235",
        "layer_0_expert_1_mp_rank_00_model_states.pt",
        _from_donor("layer_0_expert_1_mp_rank_00_model_states.pt"),
        donor="moe-ep2-s1-fp32-ws2",
    ),
    Fault(
        "moe-module-of-another-dtype",
        "moe-ep2-s2-fp32-ws2",
        "MoE ep2 stage 2 fp32: the dense module (mp_rank_00) of the same model trained in bf16",
        "CK235",
        MODEL,
        _from_donor(MODEL),
        donor="moe-ep2-s2-bf16-ws2",
    ),
    Fault(
        "expert-file-of-another-run-stage0",
        "moe-ep2-s0-bf16-ws2",
        "MoE ep2 stage 0 bf16: expert 0's file of the stage-1 bf16 run of the same model",
        "CK235",
        "layer_0_expert_0_mp_rank_00_model_states.pt",
        _from_donor("layer_0_expert_0_mp_rank_00_model_states.pt"),
        donor="moe-ep2-s1-bf16-ws2",
    ),
    Fault(
        "stage0-module-of-another-dtype",
        "s0-bf16-ws2",
        "stage 0 bf16 (FP16_UnfusedOptimizer, masters in the same file): the module of the same model trained "
        "in fp16, the masters kept",
        "CK235",
        MODEL,
        module_of_donor,
        donor="s0-fp16-ws2",
    ),
]

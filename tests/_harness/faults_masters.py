"""Corruptions of real MoE and ZeRO stage-0 DeepSpeed checkpoints (issue #17), in the style of
``faults_parallel.py`` (``FAULTS`` includes these): ckptspec must report ``code`` naming ``file``
through validate, reconstruct, load_state_dict and inspect."""

from __future__ import annotations

from pathlib import Path

from .faults import Fault, FaultEnv, _edit, tag_dir

MOE = "moe-ep2-s1-fp32-ws4"
MOE_S0 = "moe-ep2-s0-bf16-ws2"
S0 = "s0-bf16-ws2"  # FP16_UnfusedOptimizer: one fp32 master per parameter
S0_FUSED = "s0-bf16-ws2-fused"  # FP16_Optimizer: one flat fp32 group


def drop_expert_file(save_dir: Path, env: FaultEnv) -> None:
    (tag_dir(save_dir) / "layer_0_expert_3_mp_rank_00_model_states.pt").unlink()


def drop_expert_file_1(save_dir: Path, env: FaultEnv) -> None:
    (tag_dir(save_dir) / "layer_0_expert_1_mp_rank_00_model_states.pt").unlink()


def swap_expert_files(save_dir: Path, env: FaultEnv) -> None:
    """Experts 2 and 3 (same keys but their ids, same shapes and sizes) swapped."""
    a = tag_dir(save_dir) / "layer_0_expert_2_mp_rank_00_model_states.pt"
    b = tag_dir(save_dir) / "layer_0_expert_3_mp_rank_00_model_states.pt"
    tmp = a.with_name("swap.tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def wrong_partition_count(save_dir: Path, env: FaultEnv) -> None:
    """Rank 1's file says its expert group is partitioned over 4 ranks (the expert-data group has 2)."""

    def change(state):
        state["optimizer_state_dict"]["partition_count"] = [4, 4]

    _edit(tag_dir(save_dir) / "zero_pp_rank_1_mp_rank_00_optim_states.pt", change)


def stage0_copy_differs(save_dir: Path, env: FaultEnv) -> None:
    """Expert-parallel rank 1's copy of the first dense master changed."""

    def change(state):
        state["optimizer"]["fp32_groups"][0][0].add_(1.0)

    _edit(tag_dir(save_dir) / "expp_rank_1_mp_rank_00_optim_states.pt", change)


def _block_numel(module: dict, block: str) -> int:
    return sum(t.numel() for n, t in module.items() if n.startswith(block + "."))


def stage0_masters_reordered(save_dir: Path, env: FaultEnv) -> None:
    """The masters of the two Blocks (same names but their index, same shapes) in the other order in
    FP16_UnfusedOptimizer's fp32_groups: what an optimizer given the parameters in another order
    than the module's saves. Every shape still matches its name's."""

    def change(state):
        group = state["optimizer"]["fp32_groups"][0]
        half = len([n for n in state["module"] if n.startswith("blocks.0.")])
        group[: 2 * half] = group[half : 2 * half] + group[:half]

    _edit(tag_dir(save_dir) / "mp_rank_00_model_states.pt", change)


def fused_masters_reordered(save_dir: Path, env: FaultEnv) -> None:
    """The same in FP16_Optimizer's flat fp32 group: the two Blocks' masters swapped (same sizes)."""
    import torch

    def change(state):
        flat = state["optimizer"]["fp32_groups_flat"][0].detach().clone()
        n = _block_numel(state["module"], "blocks.0")
        state["optimizer"]["fp32_groups_flat"][0] = torch.cat([flat[n : 2 * n], flat[:n], flat[2 * n :]])

    _edit(tag_dir(save_dir) / "mp_rank_00_model_states.pt", change)


MASTERS_FAULTS = [
    Fault(
        "missing-expert-file",
        MOE,
        "MoE ep2 ws4: layer_0_expert_3_mp_rank_00_model_states.pt deleted after the index was generated",
        "CK240",
        "layer_0_expert_3_mp_rank_00_model_states.pt",
        drop_expert_file,
        hashed_manifest=True,
    ),
    Fault(
        "missing-expert-file-unindexed",
        MOE,
        "MoE ep2 ws4: layer_0_expert_3_mp_rank_00_model_states.pt deleted, no index recorded (was CK202, "
        '"not in an expert file")',
        "CK240",
        "layer_0_expert_3_mp_rank_00_model_states.pt",
        drop_expert_file,
    ),
    Fault(
        "missing-expert-file-stage0",
        MOE_S0,
        "MoE ep2 stage 0 bf16: layer_0_expert_1_mp_rank_00_model_states.pt deleted, no index recorded (was CK202)",
        "CK240",
        "layer_0_expert_1_mp_rank_00_model_states.pt",
        drop_expert_file_1,
    ),
    Fault(
        "swapped-expert-files",
        MOE,
        "MoE ep2 ws4: the files of experts 2 and 3 swapped (same shapes and sizes; the keys name the other expert)",
        "CK241",
        "layer_0_expert_2_mp_rank_00_model_states.pt",
        swap_expert_files,
    ),
    Fault(
        "expert-partition-count",
        MOE,
        "MoE ep2 ws4: rank 1's optimizer file records partition_count [4, 4] (the expert-data-parallel group has 2)",
        "CK242",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        wrong_partition_count,
    ),
    Fault(
        "stage0-master-copy-differs",
        MOE_S0,
        "MoE ep2 stage 0 bf16: expp_rank_1's copy of a dense fp32 master differs from expp_rank_0's",
        "CK243",
        "expp_rank_1_mp_rank_00_optim_states.pt",
        stage0_copy_differs,
    ),
    Fault(
        "stage0-masters-reordered",
        S0,
        "stage 0 bf16 (FP16_UnfusedOptimizer): the two Blocks' fp32 masters in the other order (every shape "
        "still its name's); the saved bf16 weights are not them rounded",
        "CK235",
        "mp_rank_00_model_states.pt",
        stage0_masters_reordered,
    ),
    Fault(
        "stage0-fused-masters-reordered",
        S0_FUSED,
        "stage 0 bf16 (FP16_Optimizer): the two Blocks' masters swapped inside the flat fp32 group (no shapes "
        "to compare); the saved bf16 weights are not them rounded",
        "CK235",
        "mp_rank_00_model_states.pt",
        fused_masters_reordered,
    ),
]

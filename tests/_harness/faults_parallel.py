"""Corruptions of real tensor- and pipeline-parallel DeepSpeed checkpoints (issue #16), in the style of
``faults.py`` (whose ``FAULTS`` includes these): each mutates a copy of a PARALLEL checkpoint of the
harness, and ckptspec must report ``code`` naming ``file`` through validate, reconstruct,
load_state_dict and inspect."""

from __future__ import annotations

from pathlib import Path

from .faults import Fault, FaultEnv, _edit, reconstructed_into_tag_dir, tag_dir

TP = "tp2-s1-fp32-ws2"
TPDP = "tp2dp2-s2-bf16-ws4"
PP = "pp2-s1-fp32-ws2"
PP_S0 = "pp2-s0-bf16-ws2"  # BF16_Optimizer: the index locates its masters
TPPP_EXTRAS = "tp2pp2-s1-fp32-ws4-extras"  # a tie across the stages, frozen parameters and buffers
TP_S0_BUFFERS = "tp2-s0-bf16-ws2-buffers"  # AutoTP at stage 0: each tensor rank saves the buffers whole


def drop_tp_rank(save_dir: Path, env: FaultEnv) -> None:
    """Every file of tensor rank 1 (mp_rank_01) gone."""
    for path in tag_dir(save_dir).glob("*mp_rank_01_*"):
        path.unlink()


def drop_tp_rank_optimizer(save_dir: Path, env: FaultEnv) -> None:
    next(tag_dir(save_dir).glob("*zero_pp_rank_1_mp_rank_01_optim_states.pt")).unlink()


def drop_layer_file(save_dir: Path, env: FaultEnv) -> None:
    (tag_dir(save_dir) / "layer_03-model_states.pt").unlink()


def drop_parameterless_layer_file(save_dir: Path, env: FaultEnv) -> None:
    """The ReLU's file: no tensor in it, but DeepSpeed's PipelineModule.load_state_dir opens it."""
    (tag_dir(save_dir) / "layer_01-model_states.pt").unlink()


def swap_layer_files(save_dir: Path, env: FaultEnv) -> None:
    """Layers 2 and 3 are both Blocks: same keys, shapes and sizes; only their values differ."""
    a, b = tag_dir(save_dir) / "layer_02-model_states.pt", tag_dir(save_dir) / "layer_03-model_states.pt"
    tmp = a.with_name("swap.tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def tp_rank_of_another_save(save_dir: Path, env: FaultEnv) -> None:
    """Tensor rank 1's model states say global step 3 (the other rank's, step 2)."""

    def change(state):
        state["global_steps"] = state["global_steps"] + 1

    _edit(tag_dir(save_dir) / "mp_rank_01_model_states.pt", change)


def transposed_slice(save_dir: Path, env: FaultEnv) -> None:
    """Tensor rank 1 saved its (5, 16) head.weight transposed."""

    def change(state):
        state["module"]["head.weight"] = state["module"]["head.weight"].t().contiguous()

    _edit(tag_dir(save_dir) / "mp_rank_01_model_states.pt", change)


def other_degrees(save_dir: Path, env: FaultEnv) -> None:
    def change(state):
        state["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": 4}

    _edit(tag_dir(save_dir) / "mp_rank_01_model_states.pt", change)


def replica_differs(save_dir: Path, env: FaultEnv) -> None:
    """Tensor rank 1's copy of the replicated head.bias changed (its own flat buffer shares the storage)."""

    def change(state):
        state["module"]["head.bias"].add_(1.0)

    _edit(tag_dir(save_dir) / "mp_rank_01_model_states.pt", change)


def _bump_flat(save_dir: Path, mp_rank: int, name: str, moment: str | None, element: int) -> None:
    """One element of tensor-parallel/pipeline rank ``mp_rank``'s copy of ``name`` in its ZeRO-1 optimizer file
    (data rank 0) changed by +1: its fp32 master, or Adam's ``moment``; located by the file's own
    ``param_slice_mappings``."""

    def change(state):
        osd = state["optimizer_state_dict"]
        start = osd["param_slice_mappings"][0][name].start
        flat = osd["base_optimizer_state"]["state"][0][moment] if moment else osd["single_partition_of_fp32_groups"][0]
        flat.data[start + element] += 1.0  # the fp32 partition is a leaf that requires grad

    _edit(next(tag_dir(save_dir).glob(f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_optim_states.pt")), change)


def replicated_master_copy_differs(save_dir: Path, env: FaultEnv) -> None:
    """Stage 1, tensor rank 1's copy (mp_rank_03) of the replicated head bias 5.bias: its fp32 master's last element."""
    _bump_flat(save_dir, 3, "5.bias", None, 4)


def tie_moment_copy_differs(save_dir: Path, env: FaultEnv) -> None:
    """Stage 1, tensor rank 0's copy (mp_rank_02) of the tied embedding: its exp_avg's first element (stage 0's
    copies, mp_rank_00 and mp_rank_01, unchanged)."""
    _bump_flat(save_dir, 2, "tied_modules.emb.weight", "exp_avg", 0)


def layer_buffer_copy_differs(save_dir: Path, env: FaultEnv) -> None:
    """Stage 1, tensor rank 1's copy of layer 3's buffer ``running`` in its layer file (rank 0's unchanged)."""

    def change(state):
        state["running"].add_(1.0)

    _edit(tag_dir(save_dir) / "layer_03-model_01-model_states.pt", change)


def stage0_buffer_copy_differs(save_dir: Path, env: FaultEnv) -> None:
    """AutoTP stage 0: tensor rank 1's copy of the buffer ``running`` (every tensor rank saves it whole)."""

    def change(state):
        state["module"]["running"].add_(1.0)

    _edit(tag_dir(save_dir) / "mp_rank_01_model_states.pt", change)


def no_merge_rule(save_dir: Path, env: FaultEnv) -> None:
    """The affine_map of tensor rank 0 lost the entry of blocks.0.up.weight: how it splits is unknown."""

    def change(state):
        params = state["universal_checkpoint_info"]["affine_map"]["params"]
        del params[r"^blocks\.0\.up\.weight$"]

    _edit(tag_dir(save_dir) / "mp_rank_00_model_states.pt", change)


def swap_tp_optimizer_files(save_dir: Path, env: FaultEnv) -> None:
    """Data rank 1's optimizer files of tensor ranks 0 and 1 swapped, each re-saved under the other's
    name (as a conversion script would: the archive name inside the zip then agrees with the file name,
    so CK210 cannot tell); same names, shapes and sizes."""
    import torch

    a = tag_dir(save_dir) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    b = tag_dir(save_dir) / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"
    state_a, state_b = (torch.load(p, map_location="cpu", weights_only=False) for p in (a, b))
    torch.save(state_b, a)
    torch.save(state_a, b)


def swap_tp_stage0_model_files(save_dir: Path, env: FaultEnv) -> None:
    """An AutoTP stage-0 checkpoint's two model-states files (tensor ranks 0 and 1) renamed to each other's names:
    same keys, shapes and sizes, each file's masters and weights still agree; the archive name inside each zip is
    the other file's."""
    a, b = (tag_dir(save_dir) / f"mp_rank_{tp:02d}_model_states.pt" for tp in (0, 1))
    tmp = a.with_name("swap.tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


PARALLEL_FAULTS = [
    Fault(
        "missing-tp-rank",
        TP,
        "AutoTP tp2: every file of tensor rank 1 (mp_rank_01) deleted (what is left looks like a plain ZeRO-1 "
        "checkpoint, but its model states say mp_world_size 2)",
        "CK206",
        None,
        drop_tp_rank,
    ),
    Fault(
        "missing-tp-rank-optimizer-file",
        TPDP,
        "AutoTP tp2 x dp2: tensor rank 1's optimizer file of data rank 1 deleted",
        "CK206",
        "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt",
        drop_tp_rank_optimizer,
    ),
    Fault(
        "missing-layer-file",
        PP,
        "pipeline pp2: layer_03-model_states.pt deleted (was CK607, a rule of the index made without it)",
        "CK230",
        "layer_03-model_states.pt",
        drop_layer_file,
    ),
    Fault(
        "missing-layer-file-stage0",
        PP_S0,
        "pipeline pp2 at stage 0 (BF16_Optimizer): layer_03-model_states.pt deleted",
        "CK230",
        "layer_03-model_states.pt",
        drop_layer_file,
    ),
    Fault(
        "missing-parameterless-layer-file",
        PP,
        "pipeline pp2: the ReLU's layer_01-model_states.pt (no tensor) deleted; the files alone cannot tell it from "
        "a function layer, which has none: a warning",
        "CK236",
        "layer_01-model_states.pt",
        drop_parameterless_layer_file,
        severity="warning",
    ),
    Fault(
        "missing-parameterless-layer-file-recorded",
        PP,
        "pipeline pp2: the ReLU's layer_01-model_states.pt deleted after the index was recorded",
        "CK230",
        "layer_01-model_states.pt",
        drop_parameterless_layer_file,
        hashed_manifest=True,
    ),
    Fault(
        "swapped-layer-files",
        PP,
        "pipeline pp2: layer_02 and layer_03 (two Blocks, same keys, shapes and sizes) swapped; seen by the hashes",
        "CK230",
        "layer_02-model_states.pt",
        swap_layer_files,
        hashed_manifest=True,
    ),
    Fault(
        "swapped-layer-files-unhashed",
        PP,
        "pipeline pp2: layer_02 and layer_03 swapped, no hashes recorded; their weights are not the stage's masters",
        "CK235",
        "layer_02-model_states.pt",
        swap_layer_files,
    ),
    Fault(
        "swapped-layer-files-stage0",
        PP_S0,
        "pipeline pp2 at stage 0 (BF16_Optimizer, masters located by the index): layer_02 and layer_03 swapped, no "
        "hashes recorded; their weights are not the stage's masters",
        "CK235",
        "layer_02-model_states.pt",
        swap_layer_files,
    ),
    Fault(
        "reconstructed-into-pipeline-tag-dir",
        PP,
        "pipeline pp2: `reconstruct`'s model.safetensors written into the tag directory (was CK207, an error)",
        "CK226",
        "model.safetensors",
        reconstructed_into_tag_dir,
        severity="warning",
    ),
    Fault(
        "swapped-tp-optimizer-files",
        TPDP,
        "AutoTP tp2 x dp2: data rank 1's optimizer files of tensor ranks 0 and 1 swapped and re-saved under "
        "each other's names; the masters are not the weights the model states hold",
        "CK235",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        swap_tp_optimizer_files,
    ),
    Fault(
        "swapped-tp-stage0-model-files",
        "tp2-s0-bf16-ws2",
        "AutoTP tp2 at ZeRO stage 0: the two tensor ranks' model-states files (each its shards' masters, moments and "
        "weights) swapped by renaming; re-saved under each other's names instead, nothing tells them apart",
        "CK210",
        "mp_rank_00_model_states.pt",
        swap_tp_stage0_model_files,
    ),
    Fault(
        "tp-rank-of-another-save",
        TP,
        "AutoTP tp2: tensor rank 1's model states record global step 3 where rank 0's record step 2",
        "CK232",
        "mp_rank_01_model_states.pt",
        tp_rank_of_another_save,
    ),
    Fault(
        "transposed-tp-slice",
        TP,
        "AutoTP tp2: tensor rank 1's saved head.weight transposed (16, 5)",
        "CK233",
        "mp_rank_01_model_states.pt",
        transposed_slice,
    ),
    Fault(
        "tp-degrees-disagree",
        TP,
        "AutoTP tp2: tensor rank 1's model states record tp_degree 4",
        "CK231",
        "mp_rank_01_model_states.pt",
        other_degrees,
    ),
    Fault(
        "tp-replica-differs",
        TP,
        "AutoTP tp2: tensor rank 1's copy of the replicated head.bias differs from rank 0's",
        "CK234",
        "mp_rank_01_model_states.pt",
        replica_differs,
    ),
    Fault(
        "tp-pipe-master-copy-differs",
        TPPP_EXTRAS,
        "tp2 x pp2: stage 1's tensor rank 1 holds another fp32 master of the replicated 5.bias than tensor rank 0 "
        "(one element; its saved weight unchanged): a reader takes one of the two",
        "CK237",
        "zero_pp_rank_0_mp_rank_03_optim_states.pt",
        replicated_master_copy_differs,
        reads_data=True,
    ),
    Fault(
        "tp-pipe-tie-moment-copy-differs",
        TPPP_EXTRAS,
        "tp2 x pp2 with a tied embedding: stage 1's copy of the tie's exp_avg (tensor rank 0) differs from stage "
        "0's; each target stage running the tie is given one of them",
        "CK237",
        "zero_pp_rank_0_mp_rank_02_optim_states.pt",
        tie_moment_copy_differs,
        reads_data=True,
    ),
    Fault(
        "tp-pipe-buffer-copy-differs",
        TPPP_EXTRAS,
        "tp2 x pp2: tensor rank 1's copy of layer 3's replicated buffer `running` (its layer file) differs from tensor "
        "rank 0's",
        "CK237",
        "layer_03-model_01-model_states.pt",
        layer_buffer_copy_differs,
        reads_data=True,
    ),
    Fault(
        "tp-stage0-buffer-copy-differs",
        TP_S0_BUFFERS,
        "AutoTP tp2 at ZeRO stage 0: tensor rank 1's copy of the buffer `running` differs from tensor rank 0's",
        "CK237",
        "mp_rank_01_model_states.pt",
        stage0_buffer_copy_differs,
        reads_data=True,
    ),
    Fault(
        "tp-merge-rule-unknown",
        TP,
        "AutoTP tp2: the affine_map has no entry for blocks.0.up.weight (how its shards compose is unknown)",
        "CK202",
        None,
        no_merge_rule,
    ),
]

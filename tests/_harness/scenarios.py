"""Every real-DeepSpeed job result the suite uses, by name (built by tests/_harness/tasks.py).

* MATRIX: checkpoints saved by DeepSpeed itself (spec keys: tests/_harness/job/model.py DEFAULTS).
  Each also has an ``<name>+engine`` entry: the same job re-trained in another launch, with the
  live engine's manifest recorded on every rank and no checkpoint saved (its ``live_fp32.pt``
  must equal the checkpoint's: the job is deterministic, whatever launch it runs in).
* EMBED: saved through ``ckptspec.deepspeed.save_checkpoint``, then loaded back in the same job.
* RESUMES: ``engine.load_checkpoint`` of a MATRIX checkpoint by a job of another layout.
* RESHARD_CASES: ``ckptspec reshard`` of a MATRIX checkpoint, loaded by a job of the target layout,
  with NATIVE_RESUMES (the source loaded at its own layout) as the "never stopped" reference.
* OLD_DEEPSPEED: checkpoints of an older DeepSpeed (tests/_harness/compat.py), with the live
  engine's manifests; built only by the compat tier (the default run reads committed copies).
* PARALLEL: pipeline, AutoTP, MoE, ZeRO stage 0 and universal checkpoints, with the oracles the
  job records from the live engine (spec keys and files: tests/_harness/job/parallel.py). Each
  also has an ``<name>+again`` entry: the same job trained again later in its launch, with
  nothing saved (its oracles must equal the checkpoint's). Issues #16 and #17 describe them.
"""

from __future__ import annotations

from pathlib import Path

from .tasks import Task

FEATURES = {"tied": True, "frozen": True, "buffers": True}

MATRIX_SPECS = {
    # DeepSpeed's default buckets: the checkpoint committed in tests/data (COMMITTED), which the
    # example manifests and the conformance corpus describe.
    "s2-bf16-ws2": ({"stage": 2, "dtype": "bf16", **FEATURES, "buckets": None}, 2),
    "s1-fp16-ws2": ({"stage": 1, "dtype": "fp16", **FEATURES}, 2),
    "s1-bf16-ws2": ({"stage": 1, "dtype": "bf16", **FEATURES}, 2),
    "s1-fp32-ws3-rr": ({"stage": 1, "dtype": "fp32", "round_robin": True, **FEATURES}, 3),
    "s2-fp16-ws2-groups": ({"stage": 2, "dtype": "fp16", "two_groups": True, **FEATURES}, 2),
    "s2-fp32-ws3-rr": ({"stage": 2, "dtype": "fp32", "round_robin": True, **FEATURES}, 3),
    "s2-bf16-ws2-align": ({"stage": 2, "dtype": "bf16", "parameter_alignment": True, **FEATURES}, 2),
    "s2-fp16-ws3-align": ({"stage": 2, "dtype": "fp16", "parameter_alignment": True, **FEATURES}, 3),
    "s2-bf16-ws2-exclude": ({"stage": 2, "dtype": "bf16", "exclude_frozen": True, **FEATURES}, 2),
    "s2-bf16-ws2-zero-elem": ({"stage": 2, "dtype": "bf16", "zero_elem": True, **FEATURES}, 2),
    "s2-bf16-ws1": ({"stage": 2, "dtype": "bf16", **FEATURES}, 1),
    "s2-bf16-ws4": ({"stage": 2, "dtype": "bf16", **FEATURES}, 4),
    "s3-bf16-ws2-sub": ({"stage": 3, "dtype": "bf16", "sub_group_size": 300, **FEATURES}, 2),
    "s3-fp16-ws3-groups": ({"stage": 3, "dtype": "fp16", "two_groups": True, **FEATURES}, 3),
    "s3-fp32-ws2-exclude": ({"stage": 3, "dtype": "fp32", "exclude_frozen": True, **FEATURES}, 2),
    "s1-bf16-ws2-bf16opt": ({"stage": 1, "dtype": "bf16", "grad_accum_dtype": "fp32", **FEATURES}, 2),
}
MATRIX = sorted(MATRIX_SPECS)


# Donors of the fault "module-of-another-run" only: the same model and layout as s1-fp32-ws3-rr, another seed.
# (Its stage-2 twin is no other run to every rank: fp32 stage 1 and 2 compute the same partitions bit for bit
# where the reduction order is the same, so its model states match some ranks' masters.)
DONOR_SPECS = {
    "s1-fp32-ws3-rr-seed2": ({"stage": 1, "dtype": "fp32", "round_robin": True, **FEATURES, "seed": 4321}, 3),
}

# BF16_Optimizer saved by a job whose ds_config asks for round_robin_gradients and parameter_alignment, which
# BF16_Optimizer ignores (it lays its groups out in natural order, without gaps): described, validated and resharded
# as what it is, not as a ZeRO optimizer's reordered layout (tests/deepspeed/test_bf16_optimizer_flags.py). Trained
# with the live engine's manifests recorded in the same launch.
BF16OPT_FLAGS_SPECS = {
    "s1-bf16-ws2-bf16opt-rr-align": (
        {"stage": 1, "dtype": "bf16", "grad_accum_dtype": "fp32", "round_robin": True, "parameter_alignment": True}
        | FEATURES,
        2,
    ),
}

# ZeRO stage 0 with a tie (one weight under two names: DeepSpeed records no shared_params at stage 0, the module holds
# the same tensor twice) and buffers: described, reconstructed and written as ZeRO (tests/export/test_stage0_ties.py).
# bf16 only: this job's live optimizer oracle reads a wrapped optimizer, which a stage-0 fp32 job has not
STAGE0_TIED_SPECS = {
    "s0-bf16-ws2-tied": ({"stage": 0, "dtype": "bf16", "tied": True, "buffers": True}, 2),
}

# The same model as s0-bf16-ws2-tied (a tie and buffers, no frozen parameter) saved by ZeRO-2 jobs: the sources of
# ZERO_TIED_TO_STAGE0 (a ZeRO checkpoint's tie written for a stage-0 job, tests/export/test_reshard_stage0_ties.py).
# Without the frozen layer of FEATURES: a stage-0 file's masters are named by their shapes, which the MATRIX model's
# frozen.bias ([16], as l2.bias) leaves ambiguous (reshard_stage0.refuse_untold_frozen refuses those sources).
TIED_ZERO_SPECS = {
    "s2-bf16-ws2-tied": ({"stage": 2, "dtype": "bf16", "tied": True, "buffers": True}, 2),
    "s2-fp32-ws2-tied": ({"stage": 2, "dtype": "fp32", "tied": True, "buffers": True}, 2),
}

# Sources of RESUME_CASES only: stage 0 without ties.
RESUME_SOURCE_SPECS = {
    "s0-bf16-ws2-untied": ({"stage": 0, "dtype": "bf16"}, 2),
    # ZeRO-2 without ties or frozen parameters: the sources of STAGE0_RESHARD_CASES (a stage-0 checkpoint cannot
    # tell tied or frozen masters apart)
    "s2-bf16-ws2-plain": ({"stage": 2, "dtype": "bf16"}, 2),
}

EMBED_FEATURES = {**FEATURES, "save_with": "ckptspec", "hooks": ["load_back"]}
EMBED_SPECS = {
    "embed-s1-fp16-ws2": ({"stage": 1, "dtype": "fp16", **EMBED_FEATURES}, 2),
    "embed-s2-bf16-ws3-rr-exclude": (
        {"stage": 2, "dtype": "bf16", "round_robin": True, "exclude_frozen": True, **EMBED_FEATURES},
        3,
    ),
    "embed-s3-fp16-ws2-groups-sub": (
        {"stage": 3, "dtype": "fp16", "two_groups": True, "sub_group_size": 300, **EMBED_FEATURES},
        2,
    ),
}
EMBED = sorted(EMBED_SPECS)

_UC = {"universal": True}
_UC_INJECT = {"universal": True, "inject_missing_state": True}  # no universal_checkpoint_info saved
PARALLEL_SPECS = {
    # PipelineModule, 5 layers (layer 1 has no parameters) over 2 stages
    "pp2-s1-fp32-ws2": ({"pp": 2, "stage": 1, "dtype": "fp32", **_UC_INJECT}, 2),
    "pp2-s1-bf16-ws2": ({"pp": 2, "stage": 1, "dtype": "bf16", **_UC_INJECT}, 2),
    "pp2-s0-bf16-ws2": ({"pp": 2, "stage": 0, "dtype": "bf16", **_UC_INJECT}, 2),  # BF16_Optimizer
    "pp2dp2-s1-fp32-ws4": ({"pp": 2, "stage": 1, "dtype": "fp32", **_UC_INJECT}, 4),
    "pp2dp2-s1-bf16-ws4": ({"pp": 2, "stage": 1, "dtype": "bf16", **_UC_INJECT}, 4),
    # AutoTP (tensor_parallel.autotp_size): up column-parallel, down row-parallel, head replicated
    "tp2-s1-fp32-ws2": ({"tp": 2, "stage": 1, "dtype": "fp32", **_UC}, 2),
    "tp2dp2-s2-bf16-ws4": ({"tp": 2, "stage": 2, "dtype": "bf16", **_UC}, 4),
    "tp2-s3-bf16-ws2": ({"tp": 2, "stage": 3, "dtype": "bf16", **_UC}, 2),
    # deepspeed.moe.layer.MoE, expert-parallel 2: 2 experts at world size 2, 4 (2 per rank) at 4
    **{
        f"moe-ep2-s{stage}-{dtype}-ws{ws}": (
            {"ep": 2, "experts": ws, "stage": stage, "dtype": dtype, **(_UC_INJECT if stage else _UC)},
            ws,
        )
        for ws in (2, 4)
        for stage in (0, 1, 2)
        for dtype in ("fp32", "bf16")
    },
    # dense ZeRO stage 0: fp32 (no masters); bf16 and fp16 with a client torch.optim.Adam
    # (FP16_UnfusedOptimizer: one fp32 master per parameter inside the model states) or a FusedAdam
    # (FP16_Optimizer: flat fp32 groups inside the model states; DeepSpeed's "Adam" optimizer config)
    "s0-fp32-ws2": ({"stage": 0, "dtype": "fp32", **_UC}, 2),
    "s0-bf16-ws2": ({"stage": 0, "dtype": "bf16", **_UC}, 2),
    "s0-fp16-ws2": ({"stage": 0, "dtype": "fp16", **_UC}, 2),
    "s0-bf16-ws2-fused": ({"stage": 0, "dtype": "bf16", "optimizer": "fused", "buffers": True, **_UC}, 2),
    "s0-fp16-ws2-fused": ({"stage": 0, "dtype": "fp16", "optimizer": "fused", **_UC}, 2),
    # universal sources: ds_to_universal folders beside the tag they were converted from
    "uc-s2-bf16-ws2": ({"stage": 2, "dtype": "bf16", **_UC_INJECT}, 2),
    "uc-s3-bf16-ws2": ({"stage": 3, "dtype": "bf16", **_UC}, 2),
}
PARALLEL = sorted(PARALLEL_SPECS)
# The PipelineModule at one stage (the pp1 source of a pipeline degree change, issue #40): not in PARALLEL (no
# +again, universal or hook entries), loaded by its "+optim" entry and resharded by DEGREE_RESHARDS.
PIPE_ONE_SPECS = {"pp1-s1-fp32-ws2": ({"pp": 1, "pipe": True, "stage": 1, "dtype": "fp32"}, 2)}
# The pipeline with a TiedLayerSpec (holding a frozen gain and a buffer), a frozen weight and a buffer (EXTRAS_SPECS'
# pp2 source) saved by real jobs at the layouts of its pipeline degree changes (DEGREE_RESHARDS): what ckptspec
# writes is compared with their files (tests/export/test_reshard_pipeline.py SAME_LAYOUT); the pp1 one is also the
# source of a pp1 -> pp2 change (its "+optim" entry). Not in PARALLEL: no +again, universal or hook entries.
_PIPE_EXTRAS = {"stage": 1, "dtype": "fp32", "frozen": True, "buffers": True, "tied": True}
PIPE_TARGET_SPECS = {
    "pp1-s1-fp32-ws2-extras": ({"pp": 1, "pipe": True, **_PIPE_EXTRAS}, 2),
    "pp3-s1-fp32-ws3-extras": ({"pp": 3, **_PIPE_EXTRAS}, 3),
}
# The dense MLP at ZeRO 1/2 (issue #40): the sources of a reshard to stage 0 (DEGREE_RESHARDS), the dense model
# of the "s0-" entries without ties or frozen parameters (a stage-0 checkpoint cannot tell them apart). Not in
# PARALLEL (no +again, universal or hook entries), loaded by their "+optim" entries.
ZERO_DENSE_SPECS = {
    "dense-s2-fp32-ws2": ({"stage": 2, "dtype": "fp32", "buffers": True}, 2),
    "dense-s1-fp16-ws2": ({"stage": 1, "dtype": "fp16"}, 2),
    "dense-s2-bf16-ws2": ({"stage": 2, "dtype": "bf16", "buffers": True}, 2),
    # at ZeRO-3: the source of a split for an AutoTP ZeRO-3 job (DEGREE_RESHARDS), in the stage-3 launches
    "dense-s3-bf16-ws2": ({"stage": 3, "dtype": "bf16"}, 2),
}
# The dense MLP with frozen parameters and no tie (issue #40: fine-tuning with a frozen layer), blocks.0.up.weight and
# head.bias frozen: at stage 0 (its masters named by their shapes, layout/stage0_names.frozen_apart) the source of the
# moves to ZeRO 2 and 3, at ZeRO-2 and 3 the sources of the moves to stage 0; the stage-0 and ZeRO-2 ones are
# DeepSpeed's own saves at each other's layout, which the written files are compared with. Not in PARALLEL, loaded by
# their "+optim" entries.
FROZEN_DENSE_SPECS = {
    "s0-bf16-ws2-frozen": ({"stage": 0, "dtype": "bf16", "frozen": True}, 2),
    "dense-s2-bf16-ws2-frozen": ({"stage": 2, "dtype": "bf16", "frozen": True}, 2),
    # fp32 (no mixed precision: at stage 0 the module's weights are the masters, the client torch Adam's state names
    # the trainable ones by its moments' shapes, layout/stage0_names.client_moments): the same pair
    "s0-fp32-ws2-frozen": ({"stage": 0, "dtype": "fp32", "frozen": True}, 2),
    "dense-s2-fp32-ws2-frozen": ({"stage": 2, "dtype": "fp32", "frozen": True}, 2),
    # at ZeRO-3 (each frozen parameter a rank share in frozen_param_fragments), in the stage-3 launches
    "dense-s3-bf16-ws2-frozen": ({"stage": 3, "dtype": "bf16", "frozen": True}, 2),
}
# Every tensor of a model-parallel checkpoint (issue #39, item 3): AutoTP runs whose module has frozen
# parameters (one split by AutoTP, one left whole on every tensor rank) and persistent buffers, at
# ZeRO-1 (frozen weights in the module) and ZeRO-2 (in frozen_param_fragments). One launch: same world
# size and family. Not in PARALLEL: no +again entry, tests/export/test_compose_extras.py reads them (and
# HOOKED saves them again through the hook). ``-tied``: the AutoTP MLP with two Linear layers sharing one
# weight AutoTP leaves whole (the one tie AutoTP 0.19.8 trains), in the same launch.
EXTRAS_SPECS = {
    "tp2-s1-fp32-ws2-tied": ({"tp": 2, "stage": 1, "dtype": "fp32", "tied": True}, 2),
    "tp2-s1-fp32-ws2-extras": ({"tp": 2, "stage": 1, "dtype": "fp32", "frozen": True, "buffers": True}, 2),
    "tp2-s2-bf16-ws2-extras": ({"tp": 2, "stage": 2, "dtype": "bf16", "frozen": True, "buffers": True}, 2),
    # a PipelineModule over 2 stages: a frozen weight on stage 0, a buffer on stage 1, a TiedLayerSpec
    # on both (layers 0 and 4, with a frozen gain and a buffer of its own: each stage's copy of that buffer is the
    # stage's); its own launch (pipeline family); converted by ds_to_universal too
    "pp2-s1-fp32-ws2-extras": (
        {"pp": 2, "stage": 1, "dtype": "fp32", "frozen": True, "buffers": True, "tied": True, **_UC_INJECT},
        2,
    ),
}
EXTRAS = sorted(EXTRAS_SPECS)
# A MoE at expert-parallel degree 1 (every rank holds both experts): the source of an expert degree change (issue
# #40). Not in PARALLEL, loaded by its "+optim" entry and resharded by DEGREE_RESHARDS.
EP_ONE_SPECS = {
    "moe-ep1-s1-fp32-ws2": ({"ep": 1, "experts": 2, "stage": 1, "dtype": "fp32"}, 2),
    "moe-ep1-s2-bf16-ws2": ({"ep": 1, "experts": 2, "stage": 2, "dtype": "bf16"}, 2),  # ep1 -> ep2 at ZeRO-2
}
# Two MoE layers (``moe``, ``moe2``: DeepSpeed's expert files layer_0_expert_* and layer_1_expert_*), and an fp16
# MoE with its dynamic loss scaler (issue #40): sources of expert-degree, world-size and stage changes and of a
# universal folder (DEGREE_RESHARDS), in the MoE launches of their world size. The ep2 and ep1 ones are each other's
# DeepSpeed save at the target layout (tests/export/test_reshard_moe_layers.py). Not in PARALLEL (no +again or hook
# entries), loaded by their "+optim" entries.
_MOE2 = {"moe_layers": 2, "experts": 2}
MOE_LAYERS_SPECS = {
    "moe2-ep2-s2-bf16-ws2": ({"ep": 2, **_MOE2, "stage": 2, "dtype": "bf16", **_UC_INJECT}, 2),
    "moe2-ep1-s2-bf16-ws2": ({"ep": 1, **_MOE2, "stage": 2, "dtype": "bf16"}, 2),
    # seed 1235: at 1234 moe2's gate sent no token to its experts 0 and 1 (left as built, copies of one another)
    "moe2-ep2-s2-bf16-ws4": ({"ep": 2, **_MOE2, "experts": 4, "stage": 2, "dtype": "bf16", "seed": 1235}, 4),
    # the dynamic scale doubled at each step (16 -> 64), its counters moved: none a new job starts with
    "moe2-ep2-s1-fp16-ws2": ({"ep": 2, **_MOE2, "stage": 1, "dtype": "fp16", "loss_scale_window": 1}, 2),
    # DeepSpeed's own save at the target layout of ws4 -> ws2 (4 experts on 2 ranks): compared with, not resharded
    "moe2-ep2-s2-bf16-ws2-x4": ({"ep": 2, **_MOE2, "experts": 4, "stage": 2, "dtype": "bf16"}, 2),
}
# The AutoTP MLP at ZeRO-3 with a frozen parameter split by AutoTP, one left whole and the buffers (issue #40): the
# source of a merge and a split that carry them (DEGREE_RESHARDS), in the AutoTP ZeRO-3 launches. Not in EXTRAS (no
# hook or Node reader entries), loaded by its "+optim" entry; converted by ds_to_universal too (UNIVERSAL_PARALLEL).
ZERO3_EXTRAS_SPECS = {
    "tp2-s3-bf16-ws2-extras": ({"tp": 2, "stage": 3, "dtype": "bf16", "frozen": True, "buffers": True, **_UC}, 2),
}
# Tensor x pipeline parallelism (issue #40): Megatron-style column/row-parallel layers inside a PipelineModule
# over a PipeModelDataParallelTopology (job/tp_layers.py; AutoTP cannot run in a pipeline), tp2 x pp2 at world
# size 4, the split rules saved as Megatron-DeepSpeed saves them (``universal_checkpoint_info`` in the client
# state); each rank records its masters, module and Adam moments gathered whole over its tensor group, rank 0
# DeepSpeed's ds_to_universal. In the pipeline family's world-size-4 launch. Not in PARALLEL (no +again entries); saved
# again through the save hook by HOOKED, later in the same launch.
TP_PIPE_SPECS = {
    "tp2pp2-s1-fp32-ws4": ({"tp": 2, "pp": 2, "stage": 1, "dtype": "fp32", **_UC}, 4),
    "tp2pp2-s1-bf16-ws4": ({"tp": 2, "pp": 2, "stage": 1, "dtype": "bf16", **_UC}, 4),
}
# The same tp2 x pp2 pipeline with the plain pipeline's extras (issue #40; job/tp_layers.py): a TiedLayerSpec at layers
# 0 and 4 replicated on every tensor rank (with a frozen gain and a buffer of its own), layer 2's column-parallel
# up.weight frozen (a shard per tensor rank), a buffer in layer 3's block. In the same world-size-4 launch; not in
# TP_PIPE_SPECS (whose tests read the five-layer model). ``tp2pp1-...-ws2-extras``: DeepSpeed's own save of the same
# model at tp2 x pp1 (the pipeline launch of world size 2), what ``--pipeline-parallel 1`` of it is compared with.
_TP_PIPE_EXTRAS = {"tp": 2, "stage": 1, "dtype": "fp32", "frozen": True, "buffers": True, "tied": True}
TP_PIPE_EXTRAS_SPECS = {
    "tp2pp2-s1-fp32-ws4-extras": ({**_TP_PIPE_EXTRAS, "pp": 2, **_UC}, 4),
    "tp2pp1-s1-fp32-ws2-extras": ({**_TP_PIPE_EXTRAS, "pp": 1, "pipe": True}, 2),
    # DeepSpeed's own save at tp4 x pp1 (the pipeline launch of world size 4): what ``--tensor-parallel 4`` of the two
    # above is compared with, and the source of a split to fewer tensor ranks (TP_PIPE_EXTRAS_RESHARDS)
    "tp4pp1-s1-fp32-ws4-extras": ({**_TP_PIPE_EXTRAS, "tp": 4, "pp": 1, "pipe": True}, 4),
    # the same tp2 x pp2 model in bf16 (its module, frozen parameters and buffers bf16, fp32 masters): the source of
    # the same moves (TP_PIPE_EXTRAS_RESHARDS, tests/export/test_reshard_tp_pipe_extras_bf16.py)
    "tp2pp2-s1-bf16-ws4-extras": ({**_TP_PIPE_EXTRAS, "dtype": "bf16", "pp": 2, **_UC}, 4),
}
# DeepSpeed's own save of the AutoTP MLP at ZeRO stage 0 (issue #40): what the AutoTP stage-0 targets of
# DEGREE_RESHARDS are compared with (tests/export/test_reshard_stage0.py), in the AutoTP training launch. Not in
# PARALLEL (no +again, universal or hook entries).
AUTOTP_STAGE0_SPECS = {
    "tp2-s0-bf16-ws2": ({"tp": 2, "stage": 0, "dtype": "bf16"}, 2),
    # with the MLP's two buffers (each tensor rank's file holds its own copy), converted by ds_to_universal too (which
    # fails on it): the source of the AutoTP stage-0 moves to ZeRO (DEGREE_RESHARDS; test_reshard_from_autotp_stage0.py)
    "tp2-s0-bf16-ws2-buffers": ({"tp": 2, "stage": 0, "dtype": "bf16", "buffers": True, **_UC}, 2),
    # with a frozen weight AutoTP splits and a frozen bias it leaves whole: written as ZeRO and for a stage-0 job, at
    # its tensor degree, merged and split (DEGREE_RESHARDS)
    "tp2-s0-bf16-ws2-frozen": ({"tp": 2, "stage": 0, "dtype": "bf16", "frozen": True}, 2),
    # the AutoTP MLP whose two Linear layers share one weight AutoTP leaves whole (as tp2-s1-fp32-ws2-tied), at stage 0:
    # the tie one tensor under both names in each tensor rank's module (tests/export/test_autotp_stage0_ties.py)
    "tp2-s0-bf16-ws2-tied": ({"tp": 2, "stage": 0, "dtype": "bf16", "tied": True}, 2),
}
# DeepSpeed's own save of the bf16 pipeline at stage 0 (BF16_Optimizer) at pp2 x dp2 (issue #40): what the pp2 x dp2
# stage-0 targets of DEGREE_RESHARDS are compared with, file for file (tests/export/test_reshard_pipeline_stage0.py;
# the pp2 x dp1 ones with pp2-s0-bf16-ws2), in the pipeline family's world-size-4 launch. Not in PARALLEL (no +again,
# universal or hook entries).
PIPE_STAGE0_SPECS = {
    "pp2dp2-s0-bf16-ws4": ({"pp": 2, "stage": 0, "dtype": "bf16"}, 4),
    # fp32 at stage 0: no BF16_Optimizer (the torch optimizer's state in each stage's model states), what
    # ``reshard --stage 0`` writes for fp32 pipelines, in the pipeline family's world-size-2 launch
    "pp2-s0-fp32-ws2": ({"pp": 2, "stage": 0, "dtype": "fp32"}, 2),
    # and at pp2 x dp2: what the pp2 x dp2 fp32 stage-0 targets of DEGREE_RESHARDS are compared with, file for file
    # (tests/export/test_reshard_pipeline_stage0_fp32.py), in the world-size-4 launch
    "pp2dp2-s0-fp32-ws4": ({"pp": 2, "stage": 0, "dtype": "fp32"}, 4),
    # fp16 at stage 0: FP16_UnfusedOptimizer around the client torch Adam (its fp32 masters, Adam state and dynamic
    # loss scale in each stage's model states), in the pipeline family's world-size-2 launch
    "pp2-s0-fp16-ws2": ({"pp": 2, "stage": 0, "dtype": "fp16"}, 2),
}
# The tensor x pipeline model (TP_PIPE_SPECS') at ZeRO stage 0 (issue #40): bf16 trains with BF16_Optimizer (its
# bf16_zero_pp_rank_* files per stage and tensor rank), fp32 with the torch optimizer (its state in each stage and
# tensor rank's model states). Sources of the stage-0 tp x pp moves and what ``reshard --stage 0`` of a tp x pp
# checkpoint is compared with, file for file; in the pipeline family's world-size-4 launch. Converted by ds_to_universal
# too (its outcome recorded: it fails on them). The bf16 one saved again through the save hook (MASTERS_HOOKED).
TP_PIPE_STAGE0_SPECS = {
    "tp2pp2-s0-bf16-ws4": ({"tp": 2, "pp": 2, "stage": 0, "dtype": "bf16", **_UC}, 4),
    "tp2pp2-s0-fp32-ws4": ({"tp": 2, "pp": 2, "stage": 0, "dtype": "fp32", **_UC}, 4),
}
TP_PIPE_STAGE0 = sorted(TP_PIPE_STAGE0_SPECS)  # each resumed at its own layout by its "+optim" entry
# The same PipelineModule at one stage, tp2 x pp1 (``pipe``): what DeepSpeed writes at the layout
# ``reshard --pipeline-parallel 1`` writes of a tp2 x pp2 checkpoint (TP_PIPE_STAGE_RESHARDS), file for file.
TP_PIPE_ONE_SPECS = {"tp2pp1-s1-fp32-ws2": ({"tp": 2, "pp": 1, "pipe": True, "stage": 1, "dtype": "fp32"}, 2)}
# The same PipelineModule at tp4 x pp1 (``pipe``, 4 ranks): what DeepSpeed writes at the layout ``reshard
# --tensor-parallel 4`` writes of the tp2 sources (TP_PIPE_SPLITS), file for file; in the pipeline family's
# world-size-4 launch.
TP_PIPE_FOUR_SPECS = {"tp4pp1-s1-fp32-ws4": ({"tp": 4, "pp": 1, "pipe": True, "stage": 1, "dtype": "fp32"}, 4)}
# The PipelineModule at ZeRO-1 in bf16 with fp32 gradient accumulation: DeepSpeed's BF16_Optimizer per stage (the
# configuration of Megatron-DeepSpeed's runs, #40), converted by ds_to_universal too; in the pipeline family's
# world-size-2 launch. Not in PARALLEL: no +again, universal or hook entries.
PIPE_BF16OPT_SPECS = {
    "pp2-s1-bf16-ws2-bf16opt": ({"pp": 2, "stage": 1, "dtype": "bf16", "grad_accum_dtype": "fp32", **_UC_INJECT}, 2)
}
# An AutoTP MLP of fused blocks (issue #40; parallel_models._fused_net): DeepSpeed's heuristic AutoTP makes each
# ``gate_up_proj`` a GateUpPack_LinearLayer, whose shard on a tensor rank is one piece of the gate half and one of the
# up half (a two-piece affine_map entry); ``down_proj`` row-parallel, ``head`` replicated. fp32, so the consolidated
# weights DeepSpeed gathers (``consolidated.pt``) are the masters. In the AutoTP training launch; converted by
# ds_to_universal too. Not in PARALLEL (no +again or hook entries), loaded by its "+optim" entry and resharded by
# FUSED_RESHARDS (tests/export/test_reshard_fused.py).
# Two more fused models in the same launch: "qkv", a ``qkv_proj`` DeepSpeed's heuristic rules make a fused_LinearLayer
# (q, k, v thirds: three pieces per rank); "subparam", by partition_config ``shape`` specs, a SubParamLinearLayer of
# unequal sub-parameters (32, 16, 16 rows) feeding the row-parallel SubParamLinearAllreduce (the same three along its
# input columns), in bf16 at ZeRO 2; and the gate_up_proj model at ZeRO 3 in bf16, in the AutoTP ZeRO-3 launch
# (tests/export/test_reshard_fused_layers.py).
FUSED_SPECS = {
    "tp2-s1-fp32-ws2-fused": ({"tp": 2, "stage": 1, "dtype": "fp32", "fused": True, **_UC}, 2),
    "tp2-s1-fp32-ws2-fused-qkv": ({"tp": 2, "stage": 1, "dtype": "fp32", "fused": "qkv", **_UC}, 2),
    "tp2-s2-bf16-ws2-fused-subparam": ({"tp": 2, "stage": 2, "dtype": "bf16", "fused": "subparam", **_UC}, 2),
    "tp2-s3-bf16-ws2-fused": ({"tp": 2, "stage": 3, "dtype": "bf16", "fused": True, **_UC}, 2),
    # sub-parameters DeepSpeed cuts unevenly (30, 17, 17 over 2 ranks): read and merged; a split of it refused (CK410)
    "tp2-s1-fp32-ws2-fused-uneven": ({"tp": 2, "stage": 1, "dtype": "fp32", "fused": "subparam-uneven", **_UC}, 2),
}
# Every "parallel" job's spec and world size, by name.
SOURCE_SPECS = {
    **PIPE_BF16OPT_SPECS,
    **FUSED_SPECS,
    **TP_PIPE_SPECS,
    **TP_PIPE_STAGE0_SPECS,
    **TP_PIPE_EXTRAS_SPECS,
    **TP_PIPE_ONE_SPECS,
    **TP_PIPE_FOUR_SPECS,
    **AUTOTP_STAGE0_SPECS,
    **PIPE_STAGE0_SPECS,
    **ZERO3_EXTRAS_SPECS,
    **PARALLEL_SPECS,
    **EXTRAS_SPECS,
    **PIPE_ONE_SPECS,
    **PIPE_TARGET_SPECS,
    **ZERO_DENSE_SPECS,
    **FROZEN_DENSE_SPECS,
    **EP_ONE_SPECS,
    **MOE_LAYERS_SPECS,
}
# Saved through the save hook (ckptspec.deepspeed.save_checkpoint), in the launches of the entries
# they copy: the tensor/pipeline-parallel layouts the checkpoint index describes (issue #16), and tensor x
# pipeline (TP_PIPE_SPECS, issue #40: given the split rules their own save is given).
HOOKED = [
    "pp2-s1-fp32-ws2",
    "pp2-s1-bf16-ws2",
    "pp2dp2-s1-fp32-ws4",
    "pp2dp2-s1-bf16-ws4",
    "tp2-s1-fp32-ws2",
    "tp2dp2-s2-bf16-ws4",
    "tp2-s3-bf16-ws2",
    "tp2-s1-fp32-ws2-extras",
    "tp2-s2-bf16-ws2-extras",
    "pp2-s1-fp32-ws2-extras",
    "tp2-s1-fp32-ws2-tied",
    "tp2pp2-s1-fp32-ws4",
    "tp2pp2-s1-bf16-ws4",
]


# The same for the kinds whose index locates fp32 masters (issue #17): ZeRO stage 0, MoE, the stage-0
# pipeline. Their +hook entry is also their "+again" run (the job trained again later in its launch,
# its oracles recorded before it saves), so the save hook costs these layouts no extra training. And the bf16 tensor x
# pipeline model at stage 0 (TP_PIPE_STAGE0_SPECS, issue #40: given the split rules its own save is given), re-trained
# later in the pipeline family's world-size-4 launch.
MASTERS_HOOKED = sorted(
    [*(n for n in PARALLEL_SPECS if n.startswith(("s0-", "moe-", "pp2-s0-"))), "tp2pp2-s0-bf16-ws4"]
)


# The optimizer state DeepSpeed loads from the kinds whose index locates fp32 masters (issue #39): each
# entry loaded by a job of its layout (tests/_harness/optim_job.py), the oracle of their optimizer-state
# export. Their training jobs record masters only.
OPTIM_SOURCES = sorted(n for n in PARALLEL_SPECS if n.startswith(("s0-", "moe-", "pp2-s0-")) and not n.endswith("ws1"))
# The universal folders' sources: their ZeRO tag and the folder ds_to_universal wrote, each loaded by
# DeepSpeed (tests/_harness/optim_universal_job.py), entries ``<name>+optim`` too.
OPTIM_UNIVERSAL_SOURCES = sorted(n for n in PARALLEL_SPECS if n.startswith("uc-"))
# The DCP export of every kind (issue #39): FSDP2 loads of these PARALLEL entries into the consolidated
# model (parallel_models.reference_model) at world size 2, in the launch of the other world-size-2 loads.
# Their moments' oracle is DeepSpeed's state after loading each (``+optim``; the tensor- and
# pipeline-parallel ones get their own, as DCP_OPTIM_SOURCES).
DCP_PARALLEL_SOURCES = ["moe-ep2-s2-bf16-ws2", "pp2dp2-s1-bf16-ws4", "s0-bf16-ws2", "tp2dp2-s2-bf16-ws4"]
DCP_PARALLEL_WORLD_SIZE = 2
DCP_OPTIM_SOURCES = [n for n in DCP_PARALLEL_SOURCES if n not in OPTIM_SOURCES]


# The data axis of a tensor/pipeline-parallel checkpoint resharded (issue #40): rank 0 of a job of the
# source's tensor/pipeline layout at the target world size reshards the source with ckptspec, every rank
# loads the output and records the masters and optimizer state it then holds (optim_job.py, "reshard");
# the source's own "+optim" entry is what a job of the source's layout holds.
PARALLEL_RESHARDS = {
    "tp2dp2-s2-bf16-ws4>ws2": ("tp2dp2-s2-bf16-ws4", 2),  # tp2 x dp2 -> tp2 x dp1
    "pp2dp2-s1-bf16-ws4>ws2": ("pp2dp2-s1-bf16-ws4", 2),  # pp2 x dp2 -> pp2 x dp1 (issue #40's matrix)
    "tp2-s1-fp32-ws2>ws4": ("tp2-s1-fp32-ws2", 4),  # tp2 x dp1 -> tp2 x dp2
    "pp2-s1-fp32-ws2>ws4": ("pp2-s1-fp32-ws2", 4),  # pp2 x dp1 -> pp2 x dp2
    "tp2-s3-bf16-ws2>ws4": ("tp2-s3-bf16-ws2", 4),  # tp2 x dp1 -> tp2 x dp2 at ZeRO-3 (reshard_stage3's writer)
    "tp2-s3-bf16-ws2>ws2": ("tp2-s3-bf16-ws2", 2),  # the same layout: one more step bit for bit (the same sums)
    # BF16_Optimizer per stage (bf16, grad_accum_dtype fp32, ZeRO-1: Megatron-DeepSpeed's), pp2 x dp1 -> pp2 x dp2
    "pp2-s1-bf16-ws2-bf16opt>ws4": ("pp2-s1-bf16-ws2-bf16opt", 4),
}
# The same job also loads DeepSpeed's own path to its layout (ds_to_universal's folder of the source, load_universal)
PARALLEL_RESHARDS_UNIVERSAL = {"tp2-s3-bf16-ws2>ws4", "pp2-s1-bf16-ws2-bf16opt>ws4"}
# The tensor, pipeline and expert degrees changed (issue #40): name -> (source PARALLEL entry, target world
# size, the target job's spec changes, ckptspec.reshard's options). A job of the target layout loads what
# rank 0 wrote (optim_job.py, "reshard") and records the masters and moments it then holds.
# AutoTP merged (``tensor_parallel`` 1): the target job is the same MLP without tensor parallelism; with
# ``universal``, the same job also loads DeepSpeed's ds_to_universal folder of the source (its own path).
_TP1 = {"tp": 1}
# Pipeline degree changes (ZeRO-1 only: DeepSpeed's PipelineEngine asserts "ZeRO-2 and ZeRO-3 are incompatible
# with pipeline parallelism"). ``pipe``: the PipelineModule at one stage (the target, or PIPE_ONE_SPECS' source).
_PP1 = {"pp": 1, "pipe": True}
_S0 = {"stage": 0}  # a dense ZeRO-1/2/3 checkpoint for a stage-0 job (reshard_stage0.py)
DEGREE_RESHARDS: dict[str, tuple[str, int, dict, dict]] = {
    "tp2-s1-fp32-ws2>tp1": ("tp2-s1-fp32-ws2", 2, _TP1, {"tensor_parallel": 1}),  # tp2 x dp1 -> tp1 x dp2
    "tp2dp2-s2-bf16-ws4>tp1-ws3": ("tp2dp2-s2-bf16-ws4", 3, _TP1, {"tensor_parallel": 1}),  # tp2 x dp2 -> dp3
    "tp2-s1-fp32-ws2>tp1-s2-ws3": ("tp2-s1-fp32-ws2", 3, {**_TP1, "stage": 2}, {"tensor_parallel": 1, "stage": 2}),
    "tp2-s2-bf16-ws2-extras>tp1": ("tp2-s2-bf16-ws2-extras", 2, _TP1, {"tensor_parallel": 1}),
    # an AutoTP ZeRO-3 checkpoint merged at stage 3 (tp2 x dp1 -> dp2, dp3), or at stage 2 or 1: written at stage 1/2,
    # the module's weights are the masters, cast (its saved ones are placeholders)
    "tp2-s3-bf16-ws2>tp1": ("tp2-s3-bf16-ws2", 2, _TP1, {"tensor_parallel": 1}),
    "tp2-s3-bf16-ws2>tp1-ws3": ("tp2-s3-bf16-ws2", 3, _TP1, {"tensor_parallel": 1}),
    "tp2-s3-bf16-ws2>tp1-s2": ("tp2-s3-bf16-ws2", 2, {**_TP1, "stage": 2}, {"tensor_parallel": 1, "stage": 2}),
    "tp2-s3-bf16-ws2>tp1-s1-ws3": ("tp2-s3-bf16-ws2", 3, {**_TP1, "stage": 1}, {"tensor_parallel": 1, "stage": 1}),
    # with frozen parameters (one split by AutoTP, one whole) and buffers: their fragments and shapes the target's
    "tp2-s3-bf16-ws2-extras>tp1": ("tp2-s3-bf16-ws2-extras", 2, _TP1, {"tensor_parallel": 1}),
    "tp2-s3-bf16-ws2-extras>tp1-s2": (
        "tp2-s3-bf16-ws2-extras",
        2,
        {**_TP1, "stage": 2},
        {"tensor_parallel": 1, "stage": 2},
    ),
    # split: each tensor rank's shards cut from the whole model by the source's AutoTP rules
    "tp2-s1-fp32-ws2>tp4": ("tp2-s1-fp32-ws2", 4, {"tp": 4}, {"tensor_parallel": 4}),
    "tp2dp2-s2-bf16-ws4>tp4": ("tp2dp2-s2-bf16-ws4", 4, {"tp": 4}, {"tensor_parallel": 4}),
    "tp2-s2-bf16-ws2-extras>tp4": ("tp2-s2-bf16-ws2-extras", 4, {"tp": 4}, {"tensor_parallel": 4}),
    # split at ZeRO-3: each tensor rank's shards written by the ZeRO-3 writer (reshard_stage3), from an AutoTP ZeRO-3
    # source and from a ZeRO-1 one; an AutoTP ZeRO-3 source split at ZeRO-2 (one launch more: tp4 at ZeRO-3)
    "tp2-s3-bf16-ws2>tp4": ("tp2-s3-bf16-ws2", 4, {"tp": 4}, {"tensor_parallel": 4}),
    "tp2-s1-fp32-ws2>tp4-s3": ("tp2-s1-fp32-ws2", 4, {"tp": 4, "stage": 3}, {"tensor_parallel": 4, "stage": 3}),
    "tp2-s3-bf16-ws2>tp4-s2": ("tp2-s3-bf16-ws2", 4, {"tp": 4, "stage": 2}, {"tensor_parallel": 4, "stage": 2}),
    "tp2-s3-bf16-ws2-extras>tp4": ("tp2-s3-bf16-ws2-extras", 4, {"tp": 4}, {"tensor_parallel": 4}),
    # AutoTP ZeRO-3 -> ZeRO-1/2 at the same tensor degree: each tensor coordinate's ZeRO-3 partitions written as its
    # ZeRO-1/2 partitions (tp2 x dp1 -> tp2 x dp1 at stage 2, tp2 x dp2 at stage 1; test_reshard_parallel.py)
    "tp2-s3-bf16-ws2>s2": ("tp2-s3-bf16-ws2", 2, {"stage": 2}, {"stage": 2}),
    "tp2-s3-bf16-ws2>s1-ws4": ("tp2-s3-bf16-ws2", 4, {"stage": 1}, {"stage": 1}),
    # a data-parallel checkpoint split for AutoTP by the target job's ds_config (its layer_specs)
    "dense-s2-fp32-ws2>tp2": ("dense-s2-fp32-ws2", 2, {"tp": 2}, {"tensor_parallel": 2, "ds_config": "target"}),
    "dense-s2-bf16-ws2>tp2-s1-ws4": (
        "dense-s2-bf16-ws2",
        4,
        {"tp": 2, "stage": 1},
        {"tensor_parallel": 2, "stage": 1, "ds_config": "target"},
    ),
    # a data-parallel ZeRO-3 checkpoint split for an AutoTP ZeRO-3 job: tp1 x dp2 -> tp2 x dp2; a ZeRO-2 one with
    # buffers to tp2 x dp1 at ZeRO-3
    "dense-s3-bf16-ws2>tp2-ws4": ("dense-s3-bf16-ws2", 4, {"tp": 2}, {"tensor_parallel": 2, "ds_config": "target"}),
    "dense-s2-fp32-ws2>tp2-s3": (
        "dense-s2-fp32-ws2",
        2,
        {"tp": 2, "stage": 3},
        {"tensor_parallel": 2, "stage": 3, "ds_config": "target"},
    ),
    "pp2-s1-fp32-ws2>pp1": ("pp2-s1-fp32-ws2", 2, _PP1, {"pipeline_parallel": 1}),  # pp2 -> pp1 x dp2
    "pp2-s1-bf16-ws2>pp1": ("pp2-s1-bf16-ws2", 2, _PP1, {"pipeline_parallel": 1}),
    "pp2dp2-s1-bf16-ws4>pp1": ("pp2dp2-s1-bf16-ws4", 2, _PP1, {"pipeline_parallel": 1}),  # pp2 x dp2 -> pp1 x dp2
    "pp1-s1-fp32-ws2>pp2": (
        "pp1-s1-fp32-ws2",
        2,
        {"pp": 2, "pipe": False},
        {"pipeline_parallel": 2, "partition_method": "uniform"},
    ),
    # a TiedLayerSpec on layers 0 and 4, a frozen weight (layer 2) and a buffer (layer 3): at one stage the tie
    # is one module; at 3 ("uniform": layers 0-1, 2-3, 4-5) its layers run on stages 0 and 2, each a copy
    "pp2-s1-fp32-ws2-extras>pp1": ("pp2-s1-fp32-ws2-extras", 2, _PP1, {"pipeline_parallel": 1}),
    "pp2-s1-fp32-ws2-extras>pp3": (
        "pp2-s1-fp32-ws2-extras",
        3,
        {"pp": 3},
        {"pipeline_parallel": 3, "partition_method": "uniform"},
    ),
    # the same model's real pp1 save (PIPE_TARGET_SPECS) -> pp2: the tie's one module (its gain and buffer one value in
    # layers 0 and 4) trained on both stages again
    "pp1-s1-fp32-ws2-extras>pp2": (
        "pp1-s1-fp32-ws2-extras",
        2,
        {"pp": 2, "pipe": False},
        {"pipeline_parallel": 2, "partition_method": "uniform"},
    ),
    # DeepSpeed's default partition method, layers balanced by their parameter counts: at 3 stages it cuts
    # other layers than "uniform" does (at 2 both cut after layer 2)
    "pp1-s1-fp32-ws2>pp3-parameters": (
        "pp1-s1-fp32-ws2",
        3,
        {"pp": 3, "pipe": False, "partition": "parameters"},
        {"pipeline_parallel": 3, "partition_method": "parameters"},
    ),
    # ZeRO stage 0 -> 1/2: masters and moments out of the stage-0 model states into ZeRO partitions
    "s0-fp32-ws2>s2": ("s0-fp32-ws2", 2, {"stage": 2}, {"stage": 2}),
    "s0-bf16-ws2>s1-ws3": ("s0-bf16-ws2", 3, {"stage": 1}, {"stage": 1}),
    # ... and -> ZeRO-3 (the ZeRO-3 writer, one sub-group: DeepSpeed's default size), in the ZeRO-3 launches of the
    # dense loads of those world sizes
    "s0-fp32-ws2>s3-ws3": ("s0-fp32-ws2", 3, {"stage": 3}, {"stage": 3}),
    "s0-bf16-ws2>s3": ("s0-bf16-ws2", 2, {"stage": 3}, {"stage": 3}),
    # ZeRO stage 0 -> stage 0 at another world size (reshard_stage0_world.py: the source's file, dp_world_size the
    # target's): every dtype and stage-0 optimizer wrapper the harness saves (the client torch Adam in fp32,
    # FP16_UnfusedOptimizer in bf16 and fp16 with its dynamic loss scale, FP16_Optimizer of DeepSpeed's FusedAdam with
    # buffers in bf16 and fp16), 2 -> 3 ranks, in the dense loads' world-size-3 launch
    **{f"{s}>s0-ws3": (s, 3, _S0, _S0) for s in ("s0-fp32-ws2", "s0-bf16-ws2", "s0-fp16-ws2")},
    **{f"{s}>s0-ws3": (s, 3, _S0, _S0) for s in ("s0-bf16-ws2-fused", "s0-fp16-ws2-fused")},
    # a bf16 pipeline at stage 0 (BF16_Optimizer) -> ZeRO-1, pp2 x dp1 and pp2 x dp2
    "pp2-s0-bf16-ws2>s1": ("pp2-s0-bf16-ws2", 2, {"stage": 1}, {"stage": 1}),
    "pp2-s0-bf16-ws2>s1-ws4": ("pp2-s0-bf16-ws2", 4, {"stage": 1}, {"stage": 1}),
    # an fp32 pipeline at stage 0 (the torch optimizer's state in each stage's model states) -> ZeRO-1, pp2 x dp1, x dp2
    "pp2-s0-fp32-ws2>s1": ("pp2-s0-fp32-ws2", 2, {"stage": 1}, {"stage": 1}),
    "pp2-s0-fp32-ws2>s1-ws4": ("pp2-s0-fp32-ws2", 4, {"stage": 1}, {"stage": 1}),
    # a bf16 pipeline written for a stage-0 pipeline job (BF16_Optimizer's files, reshard_pipeline_stage0.py): ZeRO-1
    # pp2 x dp1 -> pp2 x dp1 and pp2 x dp2 -> pp2 x dp1 at stage 0; the stage-0 pp2 x dp1 save -> pp2 x dp2 (no --stage:
    # it keeps its stage); ZeRO-1 pp2 -> pp3 (uniform) at stage 0 (restaged at ZeRO-1 first), and the stage-0 pp2 save
    # -> pp3 (written as ZeRO-1 first, then restaged)
    "pp2-s1-bf16-ws2>s0": ("pp2-s1-bf16-ws2", 2, _S0, _S0),
    "pp2dp2-s1-bf16-ws4>s0-ws2": ("pp2dp2-s1-bf16-ws4", 2, _S0, _S0),
    "pp2-s0-bf16-ws2>ws4": ("pp2-s0-bf16-ws2", 4, {}, {}),
    "pp2-s1-bf16-ws2>pp3-s0": (
        "pp2-s1-bf16-ws2",
        3,
        {"pp": 3, **_S0},
        {"pipeline_parallel": 3, "partition_method": "uniform", **_S0},
    ),
    "pp2-s0-bf16-ws2>pp3": ("pp2-s0-bf16-ws2", 3, {"pp": 3}, {"pipeline_parallel": 3, "partition_method": "uniform"}),
    # an fp32 pipeline written for a stage-0 fp32 pipeline job (the torch optimizer's state in each stage's model
    # states, reshard_pipeline_stage0_fp32.py): ZeRO-1 pp2 x dp1 and pp2 x dp2 -> pp2 x dp1, the stage-0 pp2 x dp1
    # save -> pp2 x dp2 (no --stage: it keeps its stage)
    "pp2-s1-fp32-ws2>s0": ("pp2-s1-fp32-ws2", 2, _S0, _S0),
    "pp2dp2-s1-fp32-ws4>s0-ws2": ("pp2dp2-s1-fp32-ws4", 2, _S0, _S0),
    "pp2-s0-fp32-ws2>ws4": ("pp2-s0-fp32-ws2", 4, {}, {}),
    # an fp16 stage-0 pipeline (FP16_UnfusedOptimizer, dynamic loss scale) for a stage-0 fp16 pipeline job at
    # pp2 x dp2 (its own stages: the only fp16 stage-0 move written)
    "pp2-s0-fp16-ws2>ws4": ("pp2-s0-fp16-ws2", 4, {}, {}),
    # and at 3 stages (uniform): restaged at ZeRO-1 first, as the bf16 ones
    "pp2-s1-fp32-ws2>pp3-s0": (
        "pp2-s1-fp32-ws2",
        3,
        {"pp": 3, **_S0},
        {"pipeline_parallel": 3, "partition_method": "uniform", **_S0},
    ),
    "pp2-s0-fp32-ws2>pp3": ("pp2-s0-fp32-ws2", 3, {"pp": 3}, {"pipeline_parallel": 3, "partition_method": "uniform"}),
    # the same through ckptspec's universal folder (export-universal), loaded with load_universal: DeepSpeed's
    # ds_to_universal refuses stage 0
    "s0-fp32-ws2>universal-s2": ("s0-fp32-ws2", 2, {"stage": 2}, {"export_universal": True}),
    "s0-bf16-ws2>universal-s1-ws3": ("s0-bf16-ws2", 3, {"stage": 1}, {"export_universal": True}),
    "pp2-s0-bf16-ws2>universal-s1-ws4": ("pp2-s0-bf16-ws2", 4, {"stage": 1}, {"export_universal": True}),
    "pp2-s0-fp32-ws2>universal-s1-ws4": ("pp2-s0-fp32-ws2", 4, {"stage": 1}, {"export_universal": True}),
    # tensor/pipeline-parallel ZeRO-1/2 through ckptspec's universal folder (export-universal), loaded with
    # load_universal; each job also loads DeepSpeed's own ds_to_universal folder of the source (UNIVERSAL_PARALLEL)
    "pp2-s1-fp32-ws2>universal-ws4": ("pp2-s1-fp32-ws2", 4, {}, {"export_universal": True}),  # pp2 -> pp2 x dp2
    "pp2-s1-bf16-ws2-bf16opt>universal-ws4": ("pp2-s1-bf16-ws2-bf16opt", 4, {}, {"export_universal": True}),
    "pp2dp2-s1-bf16-ws4>universal-ws2": ("pp2dp2-s1-bf16-ws4", 2, {}, {"export_universal": True}),  # -> pp2 x dp1
    "tp2-s1-fp32-ws2>universal-tp1": ("tp2-s1-fp32-ws2", 2, _TP1, {"export_universal": True}),  # -> tp1 x dp2
    "tp2dp2-s2-bf16-ws4>universal-tp1-ws3": ("tp2dp2-s2-bf16-ws4", 3, _TP1, {"export_universal": True}),
    "tp2-s1-fp32-ws2>universal-ws4": ("tp2-s1-fp32-ws2", 4, {}, {"export_universal": True}),  # -> tp2 x dp2
    # AutoTP at ZeRO-3: the folder loads at stage 3 (its model states keep their zero_pp_rank_ names), tp2 -> tp2 x dp2
    "tp2-s3-bf16-ws2>universal-ws4": ("tp2-s3-bf16-ws2", 4, {}, {"export_universal": True}),
    # with frozen parameters and buffers, at the same layout (tp2 x dp1): ds_to_universal fails on this source, so the
    # job loads ckptspec's folder alone (test_universal_parallel.py DS_FAILS)
    "tp2-s3-bf16-ws2-extras>universal": ("tp2-s3-bf16-ws2-extras", 2, {}, {"export_universal": True}),
    # the tie (one zero/tied_modules.<key>.<param>/ for both stages), the frozen weight and the buffer: pp2 -> pp2 x dp2
    "pp2-s1-fp32-ws2-extras>universal-ws4": ("pp2-s1-fp32-ws2-extras", 4, {}, {"export_universal": True}),
    # MoE through ckptspec's universal folder (UNIVERSAL_MOE): the same expert-parallel degree and experts per rank
    "moe-ep2-s1-fp32-ws2>universal": ("moe-ep2-s1-fp32-ws2", 2, {}, {"export_universal": True}),
    "moe-ep2-s2-bf16-ws4>universal-ws2": ("moe-ep2-s2-bf16-ws4", 2, {}, {"export_universal": True}),  # edp 2 -> 1
    # MoE at the same expert-parallel degree: the dense group over every rank, each expert group over its
    # expert-data-parallel ranks (ws4: 2 per expert group; ws2: 1)
    "moe-ep2-s1-bf16-ws4>ws2": ("moe-ep2-s1-bf16-ws4", 2, {}, {}),
    "moe-ep2-s2-fp32-ws2>ws4": ("moe-ep2-s2-fp32-ws2", 4, {}, {}),
    "moe-ep2-s1-fp32-ws4>s2-ws2": ("moe-ep2-s1-fp32-ws4", 2, {"stage": 2}, {"stage": 2}),
    # another expert-parallel degree: the experts regrouped over the expert-parallel ranks
    "moe-ep2-s1-fp32-ws2>ep1": ("moe-ep2-s1-fp32-ws2", 2, {"ep": 1}, {"expert_parallel": 1}),
    "moe-ep2-s2-bf16-ws4>ep1-ws2": ("moe-ep2-s2-bf16-ws4", 2, {"ep": 1}, {"expert_parallel": 1}),
    "moe-ep1-s1-fp32-ws2>ep2": ("moe-ep1-s1-fp32-ws2", 2, {"ep": 2}, {"expert_parallel": 2}),
    "moe-ep1-s2-bf16-ws2>ep2": ("moe-ep1-s2-bf16-ws2", 2, {"ep": 2}, {"expert_parallel": 2}),
    "moe-ep2-s1-bf16-ws4>ep4": ("moe-ep2-s1-bf16-ws4", 4, {"ep": 4}, {"expert_parallel": 4}),
    # a MoE at ZeRO stage 0 -> ZeRO-1/2: the dense masters and moments out of the model states (fp32: the module) or
    # expert-parallel rank 0's optimizer file (bf16), the experts' out of their files (fp32) or their rank's (bf16)
    "moe-ep2-s0-fp32-ws2>s2": ("moe-ep2-s0-fp32-ws2", 2, {"stage": 2}, {"stage": 2}),
    "moe-ep2-s0-bf16-ws2>s1-ep1": ("moe-ep2-s0-bf16-ws2", 2, {"stage": 1, "ep": 1}, {"stage": 1, "expert_parallel": 1}),
    "moe-ep2-s0-bf16-ws4>s2-ws2": ("moe-ep2-s0-bf16-ws4", 2, {"stage": 2}, {"stage": 2}),  # edp 2 -> 1
    # the same through ckptspec's universal folder, loaded with load_universal (DeepSpeed's ds_to_universal fails)
    "moe-ep2-s0-fp32-ws4>universal-s1-ws2": ("moe-ep2-s0-fp32-ws4", 2, {"stage": 1}, {"export_universal": True}),
    # to ZeRO stage 0 (one model-states file: fp32, the torch optimizer's state; bf16/fp16, FP16_UnfusedOptimizer's)
    "dense-s2-fp32-ws2>s0-ws3": ("dense-s2-fp32-ws2", 3, _S0, _S0),
    "dense-s1-fp16-ws2>s0": ("dense-s1-fp16-ws2", 2, _S0, _S0),
    "dense-s2-bf16-ws2>s0": ("dense-s2-bf16-ws2", 2, _S0, _S0),
    # with frozen parameters, stage 0 -> ZeRO-2 (2 -> 3 ranks) and ZeRO-3 (2 ranks), ZeRO-2 -> stage 0 (2 -> 3 ranks):
    # the frozen parameters in the module, frozen_param_shapes/fragments as DeepSpeed saves them at the target stage
    "s0-bf16-ws2-frozen>s2-ws3": ("s0-bf16-ws2-frozen", 3, {"stage": 2}, {"stage": 2}),
    "s0-bf16-ws2-frozen>s3": ("s0-bf16-ws2-frozen", 2, {"stage": 3}, {"stage": 3}),
    # and through ckptspec's universal folder (export-universal; DeepSpeed's load_universal reads no module: the frozen
    # parameters stay the job's own, the seeded ones)
    "s0-bf16-ws2-frozen>universal-s2": ("s0-bf16-ws2-frozen", 2, {"stage": 2}, {"export_universal": True}),
    "dense-s2-bf16-ws2-frozen>s0-ws3": ("dense-s2-bf16-ws2-frozen", 3, _S0, _S0),
    # fp32 (the module the masters, the torch Adam's state what tells the frozen parameters apart): stage 0 -> ZeRO-2
    # and ZeRO-2 -> stage 0, 2 -> 3 ranks, in the launches of the bf16 moves
    "s0-fp32-ws2-frozen>s2-ws3": ("s0-fp32-ws2-frozen", 3, {"stage": 2}, {"stage": 2}),
    "dense-s2-fp32-ws2-frozen>s0-ws3": ("dense-s2-fp32-ws2-frozen", 3, _S0, _S0),
    "dense-s3-bf16-ws2-frozen>s0-ws3": ("dense-s3-bf16-ws2-frozen", 3, _S0, _S0),
    # from ZeRO-3 (its "+optim" entry is optim_universal_job.py's: the source's record is "source.rank<R>.pt")
    "uc-s3-bf16-ws2>s0-ws3": ("uc-s3-bf16-ws2", 3, _S0, _S0),
    # an AutoTP checkpoint for an AutoTP stage-0 job (each tensor rank's mp_rank_XX_model_states.pt): ZeRO-3 bf16 at
    # the same tensor degree (tp2 x dp1 -> tp2 x dp1, tp2 x dp2) and split (tp4 x dp1), in the launches of the AutoTP
    # loads of those degrees and world sizes; merged for a stage-0 job without tensor parallelism: ZeRO-3 bf16 (tp2 x
    # dp1 -> 2 ranks), ZeRO-1 fp32 (tp2 x dp1 -> 3 ranks), in the launches of the dense stage-0 loads above
    "tp2-s3-bf16-ws2>s0": ("tp2-s3-bf16-ws2", 2, _S0, _S0),
    "tp2-s3-bf16-ws2>s0-ws4": ("tp2-s3-bf16-ws2", 4, _S0, _S0),
    "tp2-s3-bf16-ws2>tp4-s0": ("tp2-s3-bf16-ws2", 4, {"tp": 4, **_S0}, {"tensor_parallel": 4, **_S0}),
    # with frozen parameters (a weight AutoTP splits, a bias it leaves whole) and buffers, at the same tensor degree:
    # ZeRO-2 tp2 x dp1 -> tp2 x dp2 and ZeRO-3 tp2 x dp1 -> tp2 x dp1; ZeRO-2 merged (tp1 x dp2) and split (tp4 x dp1),
    # ZeRO-3 split (tp4 x dp1), in the launches of the other AutoTP stage-0 loads of those degrees
    "tp2-s2-bf16-ws2-extras>s0-ws4": ("tp2-s2-bf16-ws2-extras", 4, _S0, _S0),
    "tp2-s3-bf16-ws2-extras>s0": ("tp2-s3-bf16-ws2-extras", 2, _S0, _S0),
    "tp2-s2-bf16-ws2-extras>tp1-s0": (
        "tp2-s2-bf16-ws2-extras",
        2,
        {**_TP1, **_S0},
        {"tensor_parallel": 1, **_S0},
    ),
    "tp2-s2-bf16-ws2-extras>tp4-s0": (
        "tp2-s2-bf16-ws2-extras",
        4,
        {"tp": 4, **_S0},
        {"tensor_parallel": 4, **_S0},
    ),
    "tp2-s3-bf16-ws2-extras>tp4-s0": (
        "tp2-s3-bf16-ws2-extras",
        4,
        {"tp": 4, **_S0},
        {"tensor_parallel": 4, **_S0},
    ),
    "tp2-s3-bf16-ws2>tp1-s0": ("tp2-s3-bf16-ws2", 2, {**_TP1, **_S0}, {"tensor_parallel": 1, **_S0}),
    "tp2-s1-fp32-ws2>tp1-s0-ws3": ("tp2-s1-fp32-ws2", 3, {**_TP1, **_S0}, {"tensor_parallel": 1, **_S0}),
    # an AutoTP checkpoint saved at stage 0 -> ZeRO-1/2 (reshard_tensor_stage0.py): at its tensor degree (tp2 x dp1
    # ZeRO-1, tp2 x dp2 ZeRO-2), merged (tp1 x dp2 ZeRO-2), split (tp4 x dp1 ZeRO-1), and through ckptspec's universal
    # folder (tp2 x dp1 ZeRO-1; DeepSpeed's ds_to_universal fails on the source), in those layouts' launches
    "tp2-s0-bf16-ws2-buffers>s1": ("tp2-s0-bf16-ws2-buffers", 2, {"stage": 1}, {"stage": 1}),
    "tp2-s0-bf16-ws2-buffers>s2-ws4": ("tp2-s0-bf16-ws2-buffers", 4, {"stage": 2}, {"stage": 2}),
    "tp2-s0-bf16-ws2-buffers>tp1-s2": (
        "tp2-s0-bf16-ws2-buffers",
        2,
        {**_TP1, "stage": 2},
        {"tensor_parallel": 1, "stage": 2},
    ),
    "tp2-s0-bf16-ws2-buffers>tp4-s1": (
        "tp2-s0-bf16-ws2-buffers",
        4,
        {"tp": 4, "stage": 1},
        {"tensor_parallel": 4, "stage": 1},
    ),
    "tp2-s0-bf16-ws2-buffers>universal-s1": ("tp2-s0-bf16-ws2-buffers", 2, {"stage": 1}, {"export_universal": True}),
    # with frozen parameters (a weight AutoTP splits, a bias it leaves whole; named by the masters' shapes): at its
    # tensor degree (tp2 x dp2 ZeRO-2, tp2 x dp1 ZeRO-3), merged (tp1 x dp2 ZeRO-2), split (tp4 x dp1 ZeRO-1) and
    # through ckptspec's universal folder (tp2 x dp1 ZeRO-1), in the launches of the moves above
    "tp2-s0-bf16-ws2-frozen>s2-ws4": ("tp2-s0-bf16-ws2-frozen", 4, {"stage": 2}, {"stage": 2}),
    "tp2-s0-bf16-ws2-frozen>s3": ("tp2-s0-bf16-ws2-frozen", 2, {"stage": 3}, {"stage": 3}),
    "tp2-s0-bf16-ws2-frozen>tp1-s2": (
        "tp2-s0-bf16-ws2-frozen",
        2,
        {**_TP1, "stage": 2},
        {"tensor_parallel": 1, "stage": 2},
    ),
    "tp2-s0-bf16-ws2-frozen>tp4-s1": (
        "tp2-s0-bf16-ws2-frozen",
        4,
        {"tp": 4, "stage": 1},
        {"tensor_parallel": 4, "stage": 1},
    ),
    "tp2-s0-bf16-ws2-frozen>universal-s1": ("tp2-s0-bf16-ws2-frozen", 2, {"stage": 1}, {"export_universal": True}),
    # ... and for ZeRO-3 jobs: tp2 x dp1, and merged (tp1 x dp2), in the ZeRO-3 launches of those layouts
    "tp2-s0-bf16-ws2-buffers>s3": ("tp2-s0-bf16-ws2-buffers", 2, {"stage": 3}, {"stage": 3}),
    "tp2-s0-bf16-ws2-buffers>tp1-s3": (
        "tp2-s0-bf16-ws2-buffers",
        2,
        {**_TP1, "stage": 3},
        {"tensor_parallel": 1, "stage": 3},
    ),
    # ... and for AutoTP stage-0 jobs (reshard_tensor_stage0.py): at its tensor degree, another data-parallel size
    # (tp2 x dp1 -> tp2 x dp2, no --stage: it keeps its stage; each tensor rank's file, dp_world_size the target's),
    # merged (tp1 x dp2) and split (tp4 x dp1), in the launches of the AutoTP stage-0 loads of those degrees and sizes
    "tp2-s0-bf16-ws2-buffers>ws4": ("tp2-s0-bf16-ws2-buffers", 4, {}, {}),
    # with frozen parameters (a weight AutoTP splits, a bias it leaves whole; named by the masters' shapes), at its
    # tensor degree, merged (tp1 x dp2) and split (tp4 x dp1): the frozen ones in the module, merged or split
    "tp2-s0-bf16-ws2-frozen>ws4": ("tp2-s0-bf16-ws2-frozen", 4, {}, {}),
    "tp2-s0-bf16-ws2-frozen>tp1-s0": (
        "tp2-s0-bf16-ws2-frozen",
        2,
        {**_TP1, **_S0},
        {"tensor_parallel": 1, **_S0},
    ),
    "tp2-s0-bf16-ws2-frozen>tp4-s0": (
        "tp2-s0-bf16-ws2-frozen",
        4,
        {"tp": 4, **_S0},
        {"tensor_parallel": 4, **_S0},
    ),
    "tp2-s0-bf16-ws2-buffers>tp1-s0": (
        "tp2-s0-bf16-ws2-buffers",
        2,
        {**_TP1, **_S0},
        {"tensor_parallel": 1, **_S0},
    ),
    "tp2-s0-bf16-ws2-buffers>tp4-s0": (
        "tp2-s0-bf16-ws2-buffers",
        4,
        {"tp": 4, **_S0},
        {"tensor_parallel": 4, **_S0},
    ),
    # a MoE for a stage-0 MoE job (reshard_moe_stage0.py): each expert-parallel rank's optimizer file, the dense
    # module and rank 0's optimizer in the model states; from ZeRO-1/2 (edp 2 -> stage 0 at ws2) and from stage 0
    "moe-ep2-s1-fp32-ws2>s0": ("moe-ep2-s1-fp32-ws2", 2, _S0, _S0),
    "moe-ep2-s2-bf16-ws4>s0-ws2": ("moe-ep2-s2-bf16-ws4", 2, _S0, _S0),
    "moe-ep2-s0-bf16-ws2>ep1": ("moe-ep2-s0-bf16-ws2", 2, {"ep": 1}, {"expert_parallel": 1}),
    "moe-ep2-s0-fp32-ws4>ws2": ("moe-ep2-s0-fp32-ws4", 2, {}, {}),
    # two MoE layers: ep2 -> ep1 and ep1 -> ep2 (each at ZeRO-2 and to ZeRO-1), ws4 -> ws2 at ep2, the universal
    # folder; fp16 (dynamic loss scale) ep2 -> ep1 at ZeRO-1 and at ZeRO-2, and for a stage-0 job
    "moe2-ep2-s2-bf16-ws2>ep1-s1": (
        "moe2-ep2-s2-bf16-ws2",
        2,
        {"ep": 1, "stage": 1},
        {"expert_parallel": 1, "stage": 1},
    ),
    "moe2-ep2-s2-bf16-ws2>ep1": ("moe2-ep2-s2-bf16-ws2", 2, {"ep": 1}, {"expert_parallel": 1}),
    "moe2-ep1-s2-bf16-ws2>ep2-s1": (
        "moe2-ep1-s2-bf16-ws2",
        2,
        {"ep": 2, "stage": 1},
        {"expert_parallel": 2, "stage": 1},
    ),
    "moe2-ep1-s2-bf16-ws2>ep2": ("moe2-ep1-s2-bf16-ws2", 2, {"ep": 2}, {"expert_parallel": 2}),
    "moe2-ep2-s2-bf16-ws4>ws2": ("moe2-ep2-s2-bf16-ws4", 2, {}, {}),
    "moe2-ep2-s2-bf16-ws2>universal": ("moe2-ep2-s2-bf16-ws2", 2, {}, {"export_universal": True}),
    "moe2-ep2-s1-fp16-ws2>ep1": ("moe2-ep2-s1-fp16-ws2", 2, {"ep": 1}, {"expert_parallel": 1}),
    "moe2-ep2-s1-fp16-ws2>ep1-s2": (
        "moe2-ep2-s1-fp16-ws2",
        2,
        {"ep": 1, "stage": 2},
        {"expert_parallel": 1, "stage": 2},
    ),
    "moe2-ep2-s1-fp16-ws2>s0": ("moe2-ep2-s1-fp16-ws2", 2, _S0, _S0),
    # a bf16 ZeRO-1 pipeline's stages for a BF16_Optimizer pipeline job (data_types.grad_accum_dtype fp32: Megatron-
    # DeepSpeed's configuration) and the reverse, pp2 x dp1 -> pp2 x dp2 (--grad-accum-dtype; test_reshard_parallel.py)
    "pp2-s1-bf16-ws2>bf16opt-ws4": (
        "pp2-s1-bf16-ws2",
        4,
        {"grad_accum_dtype": "fp32"},
        {"grad_accum_dtype": "float32"},
    ),
    "pp2-s1-bf16-ws2-bf16opt>zero-ws4": (
        "pp2-s1-bf16-ws2-bf16opt",
        4,
        {"grad_accum_dtype": None},
        {"grad_accum_dtype": "bfloat16"},
    ),
}
# Those DeepSpeed's universal path can make too (AutoTP tp2 -> tp1): the task compares both.
UNIVERSAL_TOO = {"tp2-s1-fp32-ws2>tp1", "tp2dp2-s2-bf16-ws4>tp1-ws3", "tp2-s1-fp32-ws2>tp1-s2-ws3"}
# The universal folders of tensor/pipeline-parallel sources (test_universal_parallel.py): the job loads ckptspec's
# folder, then DeepSpeed's own of the same source, side by side.
UNIVERSAL_PARALLEL = {
    n
    for n, (source, _, _, options) in DEGREE_RESHARDS.items()
    if options.get("export_universal") and SOURCE_SPECS[source][0]["stage"] and source.startswith(("pp", "tp"))
}
# MoE: DeepSpeed's ds_to_universal fails on these sources, so there is no folder of its own to load beside (a
# stage-0 MoE's: test_reshard_moe_stage0.py, its masters read from the saving job's oracle)
UNIVERSAL_MOE = {
    n
    for n, (source, _, _, options) in DEGREE_RESHARDS.items()
    if options.get("export_universal") and source.startswith("moe") and SOURCE_SPECS[source][0]["stage"]
}
# A tensor-parallel pipeline's tensor ranks merged (issue #40): loaded by the plain PipelineModule at the same number
# of stages (the target spec: tp 1, in the pipeline optim launches of its world size), which also loads DeepSpeed's
# ds_to_universal folder of the source (load_universal). Not in DEGREE_RESHARDS: the masters and moments are
# compared with what the source job gathered whole over its tensor groups (its training oracle); its "+optim" entry
# (TP_PIPE_STEP_SOURCES) is the one-more-step reference only.
TP_PIPE_RESHARDS = {
    "tp2pp2-s1-fp32-ws4>tp1": ("tp2pp2-s1-fp32-ws4", 2, {"tp": 1}, {"tensor_parallel": 1}),  # -> tp1 x pp2 x dp1
    "tp2pp2-s1-bf16-ws4>tp1-ws4": ("tp2pp2-s1-bf16-ws4", 4, {"tp": 1}, {"tensor_parallel": 1}),  # -> tp1 x pp2 x dp2
    # ckptspec's universal folder of the source (export-universal), loaded with load_universal by the same target
    "tp2pp2-s1-fp32-ws4>universal-tp1": ("tp2pp2-s1-fp32-ws4", 2, {"tp": 1}, {"export_universal": True}),
}
# A tensor-parallel pipeline at another number of stages (issue #40): at its tensor degree (``--pipeline-parallel``:
# each tensor rank's stages moved as a pipeline of their own; tp2 x pp1 and tp2 x pp2 targets, a launch each: one
# set of degrees a launch), or merged too (``--tensor-parallel 1 --pipeline-parallel 1``: tp1 x pp1, in the
# PipelineModule's pp1 optim launch). Loaded by the target's job, which also loads ds_to_universal's folder of a
# tp2 x pp2 source; compared with what the source gathered (tests/export/test_reshard_tp_pipe_stages.py).
TP_PIPE_STAGE_RESHARDS = {
    "tp2pp2-s1-fp32-ws4>pp1": ("tp2pp2-s1-fp32-ws4", 2, {"pp": 1, "pipe": True}, {"pipeline_parallel": 1}),
    "tp2pp2-s1-bf16-ws4>pp1": ("tp2pp2-s1-bf16-ws4", 2, {"pp": 1, "pipe": True}, {"pipeline_parallel": 1}),
    # the other way: DeepSpeed's tp2 x pp1 save to two stages (tp2 x pp2 at 4 ranks: mp_rank = stage x 2 + tensor)
    "tp2pp1-s1-fp32-ws2>pp2": ("tp2pp1-s1-fp32-ws2", 4, {"pp": 2}, {"pipeline_parallel": 2}),
    "tp2pp2-s1-fp32-ws4>tp1-pp1": (
        "tp2pp2-s1-fp32-ws4",
        2,
        {"tp": 1, "pp": 1, "pipe": True},
        {"tensor_parallel": 1, "pipeline_parallel": 1},
    ),
}
# A tensor-parallel pipeline at another tensor degree (issue #40, ``--tensor-parallel 4``): from tp2 x pp1 (fp32) at
# its stages, and from tp2 x pp2 (fp32, bf16) to one stage too (``--pipeline-parallel 1``), loaded by a tp4 x pp1 job
# (4 ranks: one launch, one set of degrees), which also loads ds_to_universal's folder of a tp2 x pp2 source; and the
# tp4 x pp1 save to tp2. Compared with what the source gathered (tests/export/test_reshard_tp_pipe_split.py).
_TP4 = {"tp": 4, "pp": 1, "pipe": True}
TP_PIPE_SPLITS = {
    "tp2pp1-s1-fp32-ws2>tp4": ("tp2pp1-s1-fp32-ws2", 4, _TP4, {"tensor_parallel": 4}),
    "tp2pp2-s1-fp32-ws4>tp4-pp1": ("tp2pp2-s1-fp32-ws4", 4, _TP4, {"tensor_parallel": 4, "pipeline_parallel": 1}),
    "tp2pp2-s1-bf16-ws4>tp4-pp1": ("tp2pp2-s1-bf16-ws4", 4, _TP4, {"tensor_parallel": 4, "pipeline_parallel": 1}),
    # fewer tensor ranks: DeepSpeed's tp4 save to tp2 (in the tp2 x pp1 optim launch of TP_PIPE_STAGE_RESHARDS)
    "tp4pp1-s1-fp32-ws4>tp2": ("tp4pp1-s1-fp32-ws4", 2, {"tp": 2}, {"tensor_parallel": 2}),
}
# The extras source's moves (TP_PIPE_EXTRAS_SPECS; tests/export/test_reshard_tp_pipe_extras.py): merged (tp1 x pp2, the
# plain pipeline's extras model, in the pipeline optim launch of its degrees), at one stage keeping tp2 (tp2 x pp1),
# both (tp1 x pp1), exported (ckptspec's universal folder loaded by a tp1 x pp2 job). Each target job also loads
# ds_to_universal's folder of the source where its job wrote one.
TP_PIPE_EXTRAS_RESHARDS = {
    "tp2pp2-s1-fp32-ws4-extras>tp1": ("tp2pp2-s1-fp32-ws4-extras", 2, {"tp": 1}, {"tensor_parallel": 1}),
    "tp2pp2-s1-fp32-ws4-extras>pp1": (
        "tp2pp2-s1-fp32-ws4-extras",
        2,
        {"pp": 1, "pipe": True},
        {"pipeline_parallel": 1},
    ),
    "tp2pp2-s1-fp32-ws4-extras>universal-tp1": (
        "tp2pp2-s1-fp32-ws4-extras",
        2,
        {"tp": 1},
        {"export_universal": True},
    ),
    # merged and at one stage (tp1 x pp1 x dp2, in the PipelineModule's pp1 optim launch): the tie one module
    "tp2pp2-s1-fp32-ws4-extras>tp1-pp1": (
        "tp2pp2-s1-fp32-ws4-extras",
        2,
        {"tp": 1, "pp": 1, "pipe": True},
        {"tensor_parallel": 1, "pipeline_parallel": 1},
    ),
    # the other way: DeepSpeed's tp2 x pp1 save to two stages (tp2 x pp2 at 4 ranks): the one tied module's copy on each
    "tp2pp1-s1-fp32-ws2-extras>pp2": (
        "tp2pp1-s1-fp32-ws2-extras",
        4,
        {"pp": 2, "pipe": False},
        {"pipeline_parallel": 2},
    ),
    # another tensor degree (tests/export/test_reshard_tp_pipe_split_extras.py): split to tp4 x pp1 from tp2 x pp2 (at
    # the source's stages, then restaged) and from tp2 x pp1, loaded by tp4 x pp1 jobs (the optim launch of the tp4
    # splits); DeepSpeed's tp4 x pp1 save split to fewer tensor ranks (tp2 x pp1, the optim launch of the >pp1 targets)
    "tp2pp2-s1-fp32-ws4-extras>tp4-pp1": (
        "tp2pp2-s1-fp32-ws4-extras",
        4,
        {"tp": 4, "pp": 1, "pipe": True},
        {"tensor_parallel": 4, "pipeline_parallel": 1},
    ),
    "tp2pp1-s1-fp32-ws2-extras>tp4": ("tp2pp1-s1-fp32-ws2-extras", 4, {"tp": 4}, {"tensor_parallel": 4}),
    "tp4pp1-s1-fp32-ws4-extras>tp2": ("tp4pp1-s1-fp32-ws4-extras", 2, {"tp": 2}, {"tensor_parallel": 2}),
}
# A tensor x pipeline checkpoint's ZeRO stage changed (issue #40; tests/export/test_reshard_tp_pipe_stage0.py): the
# stage-0 sources (TP_PIPE_STAGE0_SPECS) written as ZeRO-1, each (stage, tensor rank) domain on its own
# (reshard_stage0_source), loaded by a tp2 x pp2 ZeRO-1 job; the ZeRO-1 sources (TP_PIPE_SPECS) written for a stage-0
# job (reshard_pipeline_stage0), loaded by a tp2 x pp2 stage-0 job (bf16: the load_optimizer_states=False +
# _load_zero_checkpoint load). In the optim launch of those degrees; compared with what the source job held (its
# oracle's masters, its "+optim" entry's moments, step and one more step).
TP_PIPE_STAGE0_RESHARDS = {
    "tp2pp2-s0-bf16-ws4>s1": ("tp2pp2-s0-bf16-ws4", 4, {"stage": 1}, {"stage": 1}),
    "tp2pp2-s0-fp32-ws4>s1": ("tp2pp2-s0-fp32-ws4", 4, {"stage": 1}, {"stage": 1}),
    "tp2pp2-s1-bf16-ws4>s0": ("tp2pp2-s1-bf16-ws4", 4, {"stage": 0}, {"stage": 0}),
    "tp2pp2-s1-fp32-ws4>s0": ("tp2pp2-s1-fp32-ws4", 4, {"stage": 0}, {"stage": 0}),
}
# A tensor x pipeline checkpoint at another number of stages and ZeRO stage at once (issue #40;
# tests/export/test_reshard_tp_pipe_stage0_stages.py): a stage-0 source at stage 0 (written as ZeRO-1, moved, written at
# stage 0: the bf16 one's BF16_Optimizer files) and at ZeRO-1 (written as ZeRO-1, moved), loaded by tp2 x pp1 jobs (the
# optim launch of the >pp1 targets); and DeepSpeed's tp2 x pp1 ZeRO-1 save at stage 0 on two stages (moved, written at
# stage 0), loaded by a tp2 x pp2 stage-0 job (the optim launch of the stage-0 sources' resumes), its files compared
# with DeepSpeed's own tp2 x pp2 stage-0 save. Compared with what the source held (its oracle's masters, its "+optim"
# entry's moments, step, logits and one more step).
TP_PIPE_STAGE0_STAGES = {
    "tp2pp2-s0-bf16-ws4>pp1-s0": ("tp2pp2-s0-bf16-ws4", 2, _PP1, {"pipeline_parallel": 1, "stage": 0}),
    "tp2pp2-s0-fp32-ws4>pp1-s1": (
        "tp2pp2-s0-fp32-ws4",
        2,
        {**_PP1, "stage": 1},
        {"pipeline_parallel": 1, "stage": 1},
    ),
    "tp2pp1-s1-fp32-ws2>pp2-s0": (
        "tp2pp1-s1-fp32-ws2",
        4,
        {"pp": 2, "stage": 0},
        {"pipeline_parallel": 2, "stage": 0},
    ),
}
# A tensor x pipeline checkpoint at another tensor degree and ZeRO stage at once (issue #40;
# tests/export/test_reshard_tp_pipe_stage0_degree.py; reshard_pipeline_stage0.plan_restaged): the stage-0 sources merged
# for a tp1 x pp2 stage-0 job (written as ZeRO-1, merged, written at stage 0; the fp32 one without --stage: it keeps
# stage 0) and for a ZeRO-1 one (written as ZeRO-1, merged), DeepSpeed's tp2 x pp2 ZeRO-1 save merged for a stage-0 job
# (merged, written at stage 0): the plain PipelineModule's optim launch of tp1 x pp2 x dp1; and the stage-0 sources
# split to tp4 at one stage for a tp4 x pp1 stage-0 job (written as ZeRO-1, split, moved, written at stage 0): the
# optim launch of tp4 x pp1 x dp1. Compared with what the source job gathered whole over its tensor groups (its
# oracle) and, after one more step, with its "+optim" entry (the source resumed at its own layout).
TP_PIPE_STAGE0_DEGREES = {
    "tp2pp2-s0-bf16-ws4>tp1-s0": ("tp2pp2-s0-bf16-ws4", 2, {"tp": 1}, {"tensor_parallel": 1, "stage": 0}),
    "tp2pp2-s0-fp32-ws4>tp1": ("tp2pp2-s0-fp32-ws4", 2, {"tp": 1}, {"tensor_parallel": 1}),
    "tp2pp2-s0-fp32-ws4>tp1-s1": (
        "tp2pp2-s0-fp32-ws4",
        2,
        {"tp": 1, "stage": 1},
        {"tensor_parallel": 1, "stage": 1},
    ),
    "tp2pp2-s1-bf16-ws4>tp1-s0": (
        "tp2pp2-s1-bf16-ws4",
        2,
        {"tp": 1, "stage": 0},
        {"tensor_parallel": 1, "stage": 0},
    ),
    **{
        f"tp2pp2-s0-{dtype}-ws4>tp4-pp1-s0": (
            f"tp2pp2-s0-{dtype}-ws4",
            4,
            _TP4,
            {"tensor_parallel": 4, "pipeline_parallel": 1, "stage": 0},
        )
        for dtype in ("bf16", "fp32")
    },
}
# The bf16 extras source's moves (tests/export/test_reshard_tp_pipe_extras_bf16.py): every move of the fp32 tp2 x pp2
# one, each in the optim launch of the fp32 move of the same target degrees.
TP_PIPE_EXTRAS_RESHARDS.update(
    {
        name.replace("-fp32-", "-bf16-"): ("tp2pp2-s1-bf16-ws4-extras", *rest)
        for name, (source, *rest) in list(TP_PIPE_EXTRAS_RESHARDS.items())
        if source == "tp2pp2-s1-fp32-ws4-extras"
    }
)
# The tensor x pipeline sources of TP_PIPE_RESHARDS, TP_PIPE_STAGE_RESHARDS and TP_PIPE_SPLITS, each resumed at its
# own layout by a "+optim" entry that takes the one more step (tests/export/test_reshard_tp_pipe_step.py): in the optim
# launch of that layout's degrees, beside the reshard targets of the same degrees (tp2 x pp2: tp2pp1>pp2's; tp2 x pp1:
# the >pp1 and tp4>tp2 targets'; tp4 x pp1: the splits'), so no launch of their own.
TP_PIPE_STEP_SOURCES = sorted({v[0] for v in {**TP_PIPE_RESHARDS, **TP_PIPE_STAGE_RESHARDS, **TP_PIPE_SPLITS}.values()})
# The fused source's moves (FUSED_SPECS): merged (tp1 x dp2, the same fused MLP without tensor parallelism; it also
# loads ds_to_universal's folder of the source), split over 4 tensor ranks (each rank's shard one piece of each half,
# as DeepSpeed's GateUpPack cuts it at tp4), and ckptspec's universal folder loaded at tp1 and at tp2 beside
# DeepSpeed's own (load_universal), in the optim launches of those degrees.
FUSED_RESHARDS = {
    "tp2-s1-fp32-ws2-fused>tp1": ("tp2-s1-fp32-ws2-fused", 2, {"tp": 1}, {"tensor_parallel": 1}),
    "tp2-s1-fp32-ws2-fused>tp4": ("tp2-s1-fp32-ws2-fused", 4, {"tp": 4}, {"tensor_parallel": 4}),
    "tp2-s1-fp32-ws2-fused>universal-tp1": ("tp2-s1-fp32-ws2-fused", 2, {"tp": 1}, {"export_universal": True}),
    "tp2-s1-fp32-ws2-fused>universal-tp2": ("tp2-s1-fp32-ws2-fused", 2, {}, {"export_universal": True}),
    # the fused_LinearLayer, SubParam and ZeRO-3 sources merged (tp1 x dp2) and split (tp4 x dp1)
    **{
        f"{source}>tp{tp}": (source, ws, {"tp": tp}, {"tensor_parallel": tp})
        for source in ("tp2-s1-fp32-ws2-fused-qkv", "tp2-s2-bf16-ws2-fused-subparam", "tp2-s3-bf16-ws2-fused")
        for tp, ws in ((1, 2), (4, 4))
    },
    # the uneven one merged only (its split is refused: the target's widths are not in the checkpoint)
    "tp2-s1-fp32-ws2-fused-uneven>tp1": ("tp2-s1-fp32-ws2-fused-uneven", 2, {"tp": 1}, {"tensor_parallel": 1}),
}
# Every reshard load of a changed degree or stage, by name: (source, target world size, target spec changes,
# reshard options); each loaded by its target's optim job.
DEGREE_TARGETS = {
    **DEGREE_RESHARDS,
    **TP_PIPE_RESHARDS,
    **TP_PIPE_STAGE_RESHARDS,
    **TP_PIPE_SPLITS,
    **TP_PIPE_EXTRAS_RESHARDS,
    **TP_PIPE_STAGE0_RESHARDS,
    **TP_PIPE_STAGE0_STAGES,
    **TP_PIPE_STAGE0_DEGREES,
    **FUSED_RESHARDS,
}
RESHARD_SOURCES = sorted(
    {source for source, _ in PARALLEL_RESHARDS.values()}
    | {v[0] for v in DEGREE_RESHARDS.values()}
    | {v[0] for v in FUSED_RESHARDS.values()}
)  # each with a +optim entry


def reshard_target(name: str) -> tuple[str, int, dict]:
    """A reshard load's (source, target world size, target job's spec): PARALLEL_RESHARDS or DEGREE_TARGETS."""
    if name in PARALLEL_RESHARDS:
        source, ws = PARALLEL_RESHARDS[name]
        return source, ws, SOURCE_SPECS[source][0]
    source, ws, changes, _ = DEGREE_TARGETS[name]
    return source, ws, {**source_spec(source), **changes}


def source_spec(name: str) -> dict:
    """The spec of a PARALLEL, EXTRAS, PIPE_ONE_SPECS, PIPE_TARGET_SPECS, PIPE_STAGE0_SPECS, ZERO_DENSE_SPECS,
    EP_ONE_SPECS or MOE_LAYERS_SPECS entry."""
    return SOURCE_SPECS[name][0]


def is_moe_to_stage0(name: str) -> bool:
    """A DEGREE_RESHARDS entry writing a MoE for a stage-0 MoE job (tests/export/test_reshard_moe_to_stage0.py)."""
    source, _, changes, _ = DEGREE_RESHARDS[name]
    return bool(source_spec(source).get("ep")) and {**source_spec(source), **changes}["stage"] == 0


def optim_name(name: str) -> str:
    """The entry where a job of PARALLEL entry ``name``'s layout loaded it and recorded its optimizer state."""
    return f"{name}+optim"


def hook_name(name: str) -> str:
    """The entry re-training PARALLEL job ``name`` in its launch, saved through the save hook."""
    return f"{name}+hook"


def again_name(name: str) -> str:
    """The entry re-training PARALLEL job ``name`` later in its launch (saving nothing, or through the
    save hook for MASTERS_HOOKED)."""
    return hook_name(name) if name in MASTERS_HOOKED else f"{name}+again"


# name: (saved MATRIX or RESUME_SOURCE entry, B's spec changes, B's world size, B's model change)
RESUME_CASES = {
    "resume-same-layout": ("s2-bf16-ws2", {}, 2, {}),
    "resume-world-size-2-to-3-stage2": ("s2-bf16-ws2", {}, 3, {}),
    "resume-world-size-2-to-3-stage3": ("s3-bf16-ws2-sub", {}, 3, {}),
    "resume-stage-2-to-3": ("s2-bf16-ws2", {"stage": 3}, 2, {}),
    "resume-bf16-to-fp16": ("s2-bf16-ws2", {"dtype": "fp16"}, 2, {}),
    "resume-added-param": ("s2-bf16-ws2", {}, 2, {"add_param": True}),
    "resume-changed-shape": ("s2-bf16-ws2", {}, 2, {"widen_l2": True}),
    "resume-round-robin-on": ("s2-bf16-ws2", {"round_robin": True}, 2, {}),
    # across document kinds (issue #37, H2): a ZeRO stage-0 checkpoint is described by a checkpoint index
    "resume-stage-0-same": ("s0-bf16-ws2-untied", {}, 2, {}),
    "resume-stage-0-ws2-to-3": ("s0-bf16-ws2-untied", {}, 3, {}),
    "resume-stage-0-to-2": ("s0-bf16-ws2-untied", {"stage": 2}, 2, {}),
    "resume-stage-0-bf16-to-fp32": ("s0-bf16-ws2-untied", {"dtype": "fp32"}, 2, {}),
}

# ckptspec reshard, then a real resume of its output (issue #15). name: (saved MATRIX entry, target
# world size, the target spec's changes: "stage", "sub_group_size"). Every case also takes one more
# step on the same global batch (EXTRA_STEP) as NATIVE_RESUMES: the source job resumed natively at
# its own layout (the job that never stopped) takes the same step, and the masters after it are
# compared.
RESHARD_CASES = {
    "reshard-s2-bf16-2to3": ("s2-bf16-ws2", 3, {}),
    "reshard-s2-bf16-2to2": ("s2-bf16-ws2", 2, {}),
    "reshard-s2-bf16-4to2": ("s2-bf16-ws4", 2, {}),
    "reshard-s2-fp32-rr-3to2": ("s2-fp32-ws3-rr", 2, {}),
    "reshard-s1-fp32-rr-3to2": ("s1-fp32-ws3-rr", 2, {}),
    "reshard-s1-fp16-2to3": ("s1-fp16-ws2", 3, {}),
    "reshard-s2-fp16-groups-2to3": ("s2-fp16-ws2-groups", 3, {}),
    "reshard-s2-fp16-align-3to2": ("s2-fp16-ws3-align", 2, {}),
    "reshard-s2-bf16-align-2to3": ("s2-bf16-ws2-align", 3, {}),
    "reshard-s1-to-s2-bf16-2to3": ("s1-bf16-ws2", 3, {"stage": 2}),
    "reshard-s2-to-s1-bf16-2to2": ("s2-bf16-ws2", 2, {"stage": 1}),
    # to ZeRO-3, which DeepSpeed's universal checkpoints cannot load from a stage 1/2 source
    "reshard-s2-to-s3-bf16-sub-2to3": ("s2-bf16-ws2", 3, {"stage": 3, "sub_group_size": 300}),
    "reshard-s2-to-s3-fp16-groups-2to2": ("s2-fp16-ws2-groups", 2, {"stage": 3}),
    "reshard-s1-to-s3-fp32-rr-3to2": ("s1-fp32-ws3-rr", 2, {"stage": 3, "sub_group_size": 300}),
    # from ZeRO-3 (more in RESHARD_JOB_CASES)
    "reshard-s3-fp16-groups-3to2": ("s3-fp16-ws3-groups", 2, {}),
    "reshard-s3-to-s2-fp16-groups-3to2": ("s3-fp16-ws3-groups", 2, {"stage": 2}),
    # DeepSpeed's BF16_Optimizer (bf16, grad_accum_dtype fp32, stage 1; #40): the same job config at another world
    # size (BF16_Optimizer again), and plain ZeRO-2 and ZeRO-3 jobs (bf16 gradient accumulation)
    "reshard-s1-bf16opt-2to3": ("s1-bf16-ws2-bf16opt", 3, {}),
    "reshard-s1-bf16opt-to-s2-2to3": ("s1-bf16-ws2-bf16opt", 3, {"stage": 2, "grad_accum_dtype": None}),
    "reshard-s1-bf16opt-to-s3-2to2": ("s1-bf16-ws2-bf16opt", 2, {"stage": 3, "grad_accum_dtype": None}),
    # the same config with the ZeRO flags BF16_Optimizer ignores (BF16OPT_FLAGS_SPECS)
    "reshard-s1-bf16opt-rr-align-2to3": ("s1-bf16-ws2-bf16opt-rr-align", 3, {}),
}
# The same, through tests/_harness/reshard_job.py (launches of their own): loads the
# exclude_frozen_parameters checkpoints (which DeepSpeed's strict module load refuses) non-strict.
# Both check every frozen parameter, buffer and tie of the target job against the source
# (tests/_harness/job/model_checks.py).
# No native resume of an exclude_frozen source (it would need a launch of its own): the fp32 one's
# step is checked against the plain-torch replay instead.
RESHARD_JOB_CASES = {
    "reshard-s3-bf16-sub-2to3": ("s3-bf16-ws2-sub", 3, {}),
    "reshard-s3-to-s2-bf16-sub-2to3": ("s3-bf16-ws2-sub", 3, {"stage": 2}),
    "reshard-s3-to-s1-fp32-exclude-2to3": ("s3-fp32-ws2-exclude", 3, {"stage": 1}),
    "reshard-s3-fp32-exclude-2to3": ("s3-fp32-ws2-exclude", 3, {}),
    "reshard-s2-to-s3-bf16-exclude-2to3": ("s2-bf16-ws2-exclude", 3, {"stage": 3}),
    "reshard-s2-bf16-zero-elem-2to3": ("s2-bf16-ws2-zero-elem", 3, {}),
    # the optimizer kind changed by the target job's data_types.grad_accum_dtype (#40, ``--grad-accum-dtype``): bf16
    # ZeRO-1, ZeRO-2 and ZeRO-3 sources for BF16_Optimizer jobs (fp32: the same config as s1-bf16-ws2-bf16opt's), and
    # the BF16_Optimizer source for a plain ZeRO-1 job (bf16), in the launches of the loads above
    "reshard-s1-bf16-to-bf16opt-2to3": ("s1-bf16-ws2", 3, {"grad_accum_dtype": "fp32"}),
    "reshard-s2-bf16-to-s1-bf16opt-2to2": ("s2-bf16-ws2", 2, {"stage": 1, "grad_accum_dtype": "fp32"}),
    "reshard-s3-bf16-sub-to-s1-bf16opt-2to3": ("s3-bf16-ws2-sub", 3, {"stage": 1, "grad_accum_dtype": "fp32"}),
    "reshard-s1-bf16opt-to-s1-bf16-2to3": ("s1-bf16-ws2-bf16opt", 3, {"grad_accum_dtype": "bf16"}),
}
# Universal checkpoints (tests/_harness/reshard_job.py "universal"): the source converted by
# ``ckptspec export-universal`` or by DeepSpeed's own ``ds_to_universal --inject_missing_state``, loaded
# with ``checkpoint.load_universal: true`` by a job of the target layout. name: (MATRIX entry, target
# world size, the target spec's changes, converter). The round-robin source is loaded by a job without
# round robin: DeepSpeed's universal loader places values through its own natural-order mappings, so a
# round-robin target job gets other parameters' values whatever wrote the folder.
UNIVERSAL_CASES = {
    "universal-s2-bf16-2to3": ("s2-bf16-ws2", 3, {}, "ckptspec"),
    "universal-s3-to-s2-bf16-sub-2to3": ("s3-bf16-ws2-sub", 3, {"stage": 2}, "ckptspec"),
    "universal-s2-fp32-rr-3to3-plain": ("s2-fp32-ws3-rr", 3, {"round_robin": False}, "ckptspec"),
    "universal-ds-s2-fp32-rr-3to3-plain": ("s2-fp32-ws3-rr", 3, {"round_robin": False}, "deepspeed"),
    # DeepSpeed's BF16_Optimizer (#40), loaded by the same job config (BF16_Optimizer) at 3 ranks, from both folders
    "universal-s1-bf16opt-2to3": ("s1-bf16-ws2-bf16opt", 3, {}, "ckptspec"),
    "universal-ds-s1-bf16opt-2to3": ("s1-bf16-ws2-bf16opt", 3, {}, "deepspeed"),
}
# ckptspec reshard --stage 0 (issue #40), then a real resume of its output by a stage-0 job (job/resume.py, as
# RESHARD_CASES: the masters it holds against the source's live ones, one more step against NATIVE_RESUMES).
# name: (saved RESUME_SOURCE_SPECS entry, target world size, the target spec's changes). bf16 only: resume.py's
# optimizer check (job/model.py live_optimizer_state) reads a wrapped optimizer, which a stage-0 fp32 job has not.
STAGE0_RESHARD_CASES = {
    "reshard-s2-to-s0-bf16-2to3": ("s2-bf16-ws2-plain", 3, {"stage": 0}),
}
# ckptspec reshard of a tied stage-0 source (STAGE0_TIED_SPECS) for a ZeRO job, loaded as RESHARD_JOB_CASES are (its
# masters, moments, tie and buffers against the source's, one more step against the source resumed at stage 0)
STAGE0_TIED_RESHARDS = {
    "reshard-s0-bf16-tied-to-s2-2to3": ("s0-bf16-ws2-tied", 3, {"stage": 2}),
}
# ckptspec reshard --stage 0 of a tied ZeRO-2 source (TIED_ZERO_SPECS): the tie written as one tensor under both names,
# loaded by a stage-0 job through tests/_harness/reshard_job.py (its stage-0 checks: masters and moments as the
# stage-0 optimizer holds them, the step, the tie after one more step, the logits of a fixed batch)
ZERO_TIED_TO_STAGE0 = {
    "reshard-s2-bf16-tied-to-s0-2to3": ("s2-bf16-ws2-tied", 3, {"stage": 0}),
    "reshard-s2-fp32-tied-to-s0-2to3": ("s2-fp32-ws2-tied", 3, {"stage": 0}),
}
EXTRA_STEP = {"global_batch": 12}  # splits evenly over 2, 3 and 4 ranks
SAVED_SPECS = {
    **MATRIX_SPECS,
    **RESUME_SOURCE_SPECS,
    **BF16OPT_FLAGS_SPECS,
    **STAGE0_TIED_SPECS,
    **TIED_ZERO_SPECS,
}  # every train entry a reshard reads
NATIVE_RESUMES = {
    f"native-{source}": source
    for source in sorted(
        {
            c[0]
            for cases in (
                RESHARD_CASES,
                RESHARD_JOB_CASES,
                STAGE0_RESHARD_CASES,
                STAGE0_TIED_RESHARDS,
                ZERO_TIED_TO_STAGE0,
            )
            for c in cases.values()
        }
    )
    if not SAVED_SPECS[source][0].get("exclude_frozen")
}


OLD_DEEPSPEED_SPECS = {
    "old-s1-bf16-ws2": ({"stage": 1, "dtype": "bf16", **FEATURES}, 2),
    "old-s2-fp32-ws2-groups": ({"stage": 2, "dtype": "fp32", "two_groups": True, **FEATURES}, 2),
    "old-s3-bf16-ws2": ({"stage": 3, "dtype": "bf16", **FEATURES}, 2),
}
OLD_DEEPSPEED = sorted(OLD_DEEPSPEED_SPECS)

# The DCP export's ground truth (issue #20): ZeRO-1/2/3 runs, bf16 and fp32, each with two param
# groups, a tie, a frozen parameter and buffers (besides the MATRIX points named in DCP_SOURCES),
# exported with ``ckptspec export --format dcp`` and loaded by FSDP2 jobs of world size 1, 2 and 3
# (tests/_harness/fsdp2_job.py): one launch per world size, every source in it.
_DCP = {**FEATURES, "two_groups": True}
DCP_SOURCE_SPECS = {
    f"dcp-s{stage}-{dtype}-ws2-groups": ({"stage": stage, "dtype": dtype, **_DCP}, 2)
    for stage in (1, 2, 3)
    for dtype in ("bf16", "fp32")
}
DCP_SOURCES = sorted(DCP_SOURCE_SPECS) + ["s2-fp32-ws3-rr", "s3-fp16-ws3-groups", "s1-bf16-ws2-bf16opt"]
FSDP2_WORLD_SIZES = (1, 2, 3)


def fsdp2_name(source: str, world_size: int) -> str:
    """The entry where an FSDP2 job of ``world_size`` loaded the DCP export of ``source``."""
    return f"fsdp2-ws{world_size}-{source}"


# The DCP reader (issue #41): FSDP2 jobs of world size 1, 2 and 3 load these checkpoints in place
# (``ckptspec.DeepSpeedReader``, no export; fsdp2_job.py ``"reader": true``), in the launches of the loads above.
DCP_READER_SOURCES = ["dcp-s2-bf16-ws2-groups", "dcp-s3-fp32-ws2-groups", *DCP_PARALLEL_SOURCES]


def fsdp2_reader_name(source: str, world_size: int) -> str:
    """The entry where an FSDP2 job of ``world_size`` loaded ``source`` through the DCP reader."""
    return f"fsdp2-reader-ws{world_size}-{source}"


# The reader's jobs beyond one node (#41): name -> (source, world size, nodes, fsdp2_job.py options). Those of
# world size 4 run as two torchrun agents of two ranks each (``--nnodes 2``; one launch): FSDP2 on a 1-D mesh (every
# source above), HSDP on a 2x2 mesh (replicated across the nodes, sharded within each), and HSDP whose reader and
# ``dcp.load`` run on each node's shard group (``process_group=``). The HTTP one reads the checkpoint from nginx's
# URL, in the world-size-2 launch above.
REMOTE_SMALL_READS = {"TAIL": 1024, "READ_AHEAD": 0, "CHUNK": 4096}  # validation keeps no tensor's bytes
DCP_READER_JOBS = {
    **{f"fsdp2-reader-nodes2-{source}": (source, 4, 2, {}) for source in DCP_READER_SOURCES},
    "fsdp2-reader-hsdp-nodes2-dcp-s2-bf16-ws2-groups": ("dcp-s2-bf16-ws2-groups", 4, 2, {"mesh": [2, 2]}),
    "fsdp2-reader-hsdp-group-nodes2-dcp-s3-fp32-ws2-groups": (
        "dcp-s3-fp32-ws2-groups",
        4,
        2,
        {"mesh": [2, 2], "group": "shard"},
    ),
    "fsdp2-reader-http-ws2-dcp-s2-bf16-ws2-groups": ("dcp-s2-bf16-ws2-groups", 2, 1, {"http": REMOTE_SMALL_READS}),
}


# DCP as an input (issue #42): FSDP2 jobs of world size 1, 2 and 3 train the tiny model (two param groups, a tie, a
# frozen parameter, buffers) with AdamW and save DCP checkpoints (tests/_harness/dcp_save_job.py): one launch each.
DCP_SAVE_SPEC = {**FEATURES, "two_groups": True, "stage": 0, "dtype": "fp32"}
DCP_SAVE_WORLD_SIZES = (1, 2, 3)


def dcp_save_name(world_size: int) -> str:
    """The entry where an FSDP2 job of ``world_size`` saved its DCP checkpoints and their oracles."""
    return f"dcpsave-ws{world_size}"


# FSDP -> DeepSpeed (issue #42): ``ckptspec reshard`` of a DCP save above into a ZeRO checkpoint, loaded by a DeepSpeed
# job of the same model and param groups (reshard_job.py "dcp"). name: (saving world size, target world size, stage,
# the target job's dtype). Four launches (ZeRO-3 jobs apart, tasks.py): stage 1/2 at world size 2 and 3, stage 3 at
# world size 2 and 3; every stage at both target world sizes and in bf16, every saving world size once at least. The
# target jobs clip no gradient, as the FSDP2 job (DeepSpeed's default gradient_clipping is 1.0): their one more step
# is the FSDP2 job's second (in bf16: on bf16 weights).
DCP_RESHARDS = {
    "dcp-ws3>s2-ws2": (3, 2, 2, "fp32"),  # FSDP2's uneven row chunks (17/17/16 of 50)
    "dcp-ws2>s1-ws2": (2, 2, 1, "fp32"),
    "dcp-ws3>s2-ws2-bf16": (3, 2, 2, "bf16"),
    "dcp-ws2>s1-ws3": (2, 3, 1, "fp32"),
    "dcp-ws3>s2-ws3": (3, 3, 2, "fp32"),
    "dcp-ws1>s2-ws3": (
        1,
        3,
        2,
        "fp32",
    ),  # a save of one rank: every entry whole (its frozen parameters read as buffers)
    "dcp-ws2>s1-ws3-bf16": (2, 3, 1, "bf16"),
    "dcp-ws3>s3-ws2": (3, 2, 3, "fp32"),
    "dcp-ws2>s3-ws2-bf16": (2, 2, 3, "bf16"),
    "dcp-ws2>s3-ws3": (2, 3, 3, "fp32"),
    "dcp-ws3>s3-ws3": (3, 3, 3, "fp32"),
}


# MATRIX checkpoints also committed to the repository (``scripts/compat.sh --refresh`` writes
# them): a fault of tests/_harness/faults.py with base ``committed:<name>`` mutates a copy, so a
# test of a new CK2xx check needs neither DeepSpeed nor a job.
COMMITTED_DIR = Path(__file__).resolve().parents[1] / "data" / "deepspeed-0.19.8"
COMMITTED = {"s2-bf16-ws2": COMMITTED_DIR / "s2-bf16-ws2"}


# transformers' Trainer on DeepSpeed with ckptspec's callback (issue #43, tests/integrations): ZeRO-2 and ZeRO-3 at
# world size 2, four steps saved every two (checkpoint-2, checkpoint-4), then the resume from a corrupted copy.
TRAINER_RUNS = {f"trainer-s{stage}-ws2": {"stage": stage, "steps": 4, "save_steps": 2, "seed": 0} for stage in (2, 3)}
# accelerate's save_state/load_state through ckptspec (accelerate_job.py): saves at steps 2 and 4, then the loads
ACCELERATE_RUNS = {f"accelerate-s{stage}-ws2": {"stage": stage, "seed": 0} for stage in (2, 3)}


def engine_name(name: str) -> str:
    """The entry holding the live engine's manifests of MATRIX checkpoint ``name``."""
    return f"{name}+engine"


def _registry() -> dict[str, Task]:
    out: dict[str, Task] = {}
    for specs in (MATRIX_SPECS, EMBED_SPECS, RESUME_SOURCE_SPECS, DONOR_SPECS, STAGE0_TIED_SPECS, TIED_ZERO_SPECS):
        out.update({name: Task("train", spec, ws) for name, (spec, ws) in specs.items()})
    for name, (spec, ws) in BF16OPT_FLAGS_SPECS.items():
        out[name] = Task("train", {**spec, "hooks": ["engine_manifest"]}, ws)
    for name, (spec, ws) in MATRIX_SPECS.items():
        out[engine_name(name)] = Task("train", {**spec, "save": False, "hooks": ["engine_manifest"]}, ws)
    for name, (spec, ws) in DCP_SOURCE_SPECS.items():
        out[name] = Task("train", spec, ws)
    for source in DCP_SOURCES:
        spec = {**MATRIX_SPECS, **DCP_SOURCE_SPECS}[source][0]
        for ws in FSDP2_WORLD_SIZES:
            out[fsdp2_name(source, ws)] = Task("fsdp2", {"spec": spec, "source": source}, ws, load=source)
    for source in DCP_READER_SOURCES:
        parallel = source in DCP_PARALLEL_SOURCES
        spec = (PARALLEL_SPECS if parallel else DCP_SOURCE_SPECS)[source][0]
        args = {"spec": spec, "source": source, "reader": True, **({"parallel": True} if parallel else {})}
        for ws in FSDP2_WORLD_SIZES:
            out[fsdp2_reader_name(source, ws)] = Task("fsdp2", args, ws, load=source)
    for name, (source, ws, nodes, options) in DCP_READER_JOBS.items():
        parallel = source in DCP_PARALLEL_SOURCES
        spec = (PARALLEL_SPECS if parallel else DCP_SOURCE_SPECS)[source][0]
        args = {"spec": spec, "source": source, "reader": True, **({"parallel": True} if parallel else {}), **options}
        out[name] = Task("fsdp2", args, ws, load=source, nodes=nodes)
    for ws in DCP_SAVE_WORLD_SIZES:
        out[dcp_save_name(ws)] = Task("dcp_save", {"spec": DCP_SAVE_SPEC}, ws)
    for name, args in TRAINER_RUNS.items():
        out[name] = Task("trainer", args, 2)
    for name, args in ACCELERATE_RUNS.items():
        out[name] = Task("accelerate", args, 2)
    for name, (spec, ws) in SOURCE_SPECS.items():
        out[name] = Task("parallel", spec, ws)
    for name, (spec, ws) in PARALLEL_SPECS.items():
        if name not in MASTERS_HOOKED:
            out[again_name(name)] = Task("parallel", {**spec, "save": False, "universal": False}, ws)
    for name in HOOKED + MASTERS_HOOKED:
        spec, ws = {**PARALLEL_SPECS, **EXTRAS_SPECS, **TP_PIPE_SPECS, **TP_PIPE_STAGE0_SPECS}[name]
        out[hook_name(name)] = Task("parallel", {**spec, "save_with": "ckptspec", "universal": False}, ws)
    for name in sorted({*OPTIM_SOURCES, *DCP_OPTIM_SOURCES, *RESHARD_SOURCES, *TP_PIPE_STEP_SOURCES, *TP_PIPE_STAGE0}):
        spec, ws = SOURCE_SPECS[name]
        out[optim_name(name)] = Task("optim", {"spec": spec, "source": name}, ws, load=name)
    for name in OPTIM_UNIVERSAL_SOURCES:
        spec, ws = PARALLEL_SPECS[name]
        out[optim_name(name)] = Task("optim_universal", {"spec": spec, "source": name}, ws, load=name)
    for source in DCP_PARALLEL_SOURCES:
        spec, ws = PARALLEL_SPECS[source][0], DCP_PARALLEL_WORLD_SIZE
        args = {"spec": spec, "source": source, "parallel": True}
        out[fsdp2_name(source, ws)] = Task("fsdp2", args, ws, load=source)
    for name, (source, ws) in PARALLEL_RESHARDS.items():
        spec = SOURCE_SPECS[source][0]
        args = {"spec": spec, "source": source, "reshard": {"world_size": ws}}
        if name in PARALLEL_RESHARDS_UNIVERSAL:
            args["universal"] = True
        out[name] = Task("optim", args, ws, load=source)
    for name, (source, ws, _, options) in DEGREE_RESHARDS.items():
        spec = reshard_target(name)[2]
        args = {"spec": spec, "source": source, "reshard": {"world_size": ws, **options}}
        out[name] = Task("optim", {**args, "universal": name in UNIVERSAL_TOO | UNIVERSAL_PARALLEL}, ws, load=source)
    for name, (source, ws, _, options) in DEGREE_TARGETS.items():
        if name in DEGREE_RESHARDS:
            continue
        args = {"spec": reshard_target(name)[2], "source": source, "reshard": {"world_size": ws, **options}}
        # and ds_to_universal's folder of the source, where its job wrote one (it fails on a stage-0 source)
        universal = bool(source_spec(source).get("universal")) and source_spec(source)["stage"] > 0
        out[name] = Task("optim", {**args, "universal": universal}, ws, load=source)
    for name, (source, changes, ws, change) in RESUME_CASES.items():
        spec = {**{**MATRIX_SPECS, **RESUME_SOURCE_SPECS}[source][0], **changes}
        out[name] = Task("resume", {"spec": spec, "change": change}, ws, load=source)
    for name, (source, ws, changes) in {**RESHARD_CASES, **STAGE0_RESHARD_CASES}.items():
        spec = {**SAVED_SPECS[source][0], **changes}
        reshard = {"world_size": ws, "stage": changes.get("stage"), "sub_group_size": changes.get("sub_group_size")}
        args = {"spec": spec, "change": {}, "reshard": reshard, "extra_step": EXTRA_STEP}
        out[name] = Task("resume", args, ws, load=source)
    for name, (source, ws, changes) in RESHARD_JOB_CASES.items():
        spec = {**MATRIX_SPECS[source][0], **changes}
        reshard = {"world_size": ws, "stage": changes.get("stage"), "sub_group_size": changes.get("sub_group_size")}
        if changes.get("grad_accum_dtype"):  # ckptspec.reshard's grad_accum_dtype (the other tasks' keys as they were)
            reshard["grad_accum_dtype"] = {"fp32": "float32", "bf16": "bfloat16"}[changes["grad_accum_dtype"]]
        args = {"spec": spec, "reshard": reshard, "extra_step": EXTRA_STEP}
        out[name] = Task("reshard", args, ws, load=source)
    for name, (source, ws, changes) in {**STAGE0_TIED_RESHARDS, **ZERO_TIED_TO_STAGE0}.items():
        spec = {**SAVED_SPECS[source][0], **changes}
        # through the public ckptspec.reshard (reshard_job.py: a grad_accum_dtype key, None), which reads every kind
        reshard = {"world_size": ws, "stage": changes["stage"], "sub_group_size": None, "grad_accum_dtype": None}
        out[name] = Task("reshard", {"spec": spec, "reshard": reshard, "extra_step": EXTRA_STEP}, ws, load=source)
    for name, (saved, ws, stage, dtype) in DCP_RESHARDS.items():
        spec = {**DCP_SAVE_SPEC, "stage": stage, "dtype": dtype, "config": {"gradient_clipping": 0.0}}
        args = {"spec": spec, "reshard": {"world_size": ws, "stage": stage, "model_dtype": dtype}, "dcp": True}
        out[name] = Task("reshard", args, ws, load=dcp_save_name(saved))
    for name, (source, ws, changes, how) in UNIVERSAL_CASES.items():
        spec = {**MATRIX_SPECS[source][0], **changes}
        out[name] = Task("reshard", {"spec": spec, "universal": how, "extra_step": EXTRA_STEP}, ws, load=source)
    for name, source in NATIVE_RESUMES.items():
        spec, ws = SAVED_SPECS[source]
        out[name] = Task("resume", {"spec": spec, "change": {}, "extra_step": EXTRA_STEP}, ws, load=source)
    from .compat import OLD_DEEPSPEED_VERSION

    for name, (spec, ws) in OLD_DEEPSPEED_SPECS.items():
        out[name] = Task("train", {**spec, "hooks": ["engine_manifest"]}, ws, deepspeed=OLD_DEEPSPEED_VERSION)
    return out


REGISTRY = _registry()

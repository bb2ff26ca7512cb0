"""Generate the conformance corpus: the valid manifests of format 1.0, and all of format 1.1.

    python tests/conformance/make_corpus.py          # (re)write 1.0/valid/*.json and 1.1/
    python tests/conformance/make_corpus.py --check  # exit 1 if a committed file differs

The layout numbers (offsets, paddings, padded/partition/saved numels, locators)
are derived here from the rules of docs/spec.md, independently of ``ckptspec``:
this script imports nothing from the package, so the corpus is a second,
independent statement of the rules. For format 1.0 only the *valid* files are
generated; each invalid file is a hand edit of one of them (see ``1.0/expected.json``),
kept as a static file so that it breaks exactly one rule. For format 1.1 every file is
generated, the invalid ones as one named edit of a valid one, and so is
``1.1/expected.json``: each edit states the codes it must produce.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VALID = HERE / "1.0" / "valid"
EXAMPLE = HERE.parent.parent / "examples" / "manifests" / "zero2-bf16-2ranks.json"
EXAMPLE_1_1 = HERE.parent.parent / "examples" / "manifests" / "zero2-bf16-2ranks-1.1.json"
CORPUS_1_1 = HERE / "1.1"

ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}
NCCL_START_ALIGNMENT_FACTOR = 2  # stage 1/2 flat groups are padded to 2 x world size
ZIP_HEADER = 1024  # where the first tensor data starts in a fake torch zip file
ZIP_ALIGN = 64  # torch aligns every zip member's data to 64 bytes
ZIP_TRAILER = 700  # central directory etc. after the last member


# --------------------------------------------------------------------------- pieces


def producer(**extra) -> dict:
    doc = {
        "tool": "ckptspec-corpus",
        "tool_version": "1.0.0",
        "framework": "deepspeed",
        "framework_version": "0.19.8",
        "created": "2026-11-29T12:00:00Z",
    }
    doc.update(extra)
    return doc


def layout(stage: int, world_size: int, *, model_dtype="bfloat16", master_dtype="float32", round_robin=False,
           parameter_alignment=False, tail_padding_saved=False, **optional) -> dict:
    doc = {
        "zero_stage": stage,
        "world_size": world_size,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "model_dtype": model_dtype,
        "master_dtype": master_dtype,
        "round_robin": round_robin,
        "parameter_alignment": parameter_alignment,
        "tail_padding_saved": tail_padding_saved,
    }
    doc.update(optional)
    return doc


def tensor(name: str, shape: list[int], dtype: str) -> dict:
    return {"name": name, "shape": list(shape), "numel": math.prod(shape), "dtype": dtype}


def flat_group(optimizer_group: int, params: list[tuple[str, list[int], str]], *, stage: int, partition_count: int,
               tail_padding_saved: bool, paddings: list[int] | None = None) -> dict:
    """Stage 0/1/2: params back to back (offset + numel + padding), the end rounded up to
    the alignment (2 x partition_count at stage 1/2, 1 at stage 0), split into equal
    partitions; without tail_padding_saved each rank saves only the real elements of its
    partition: clamp(end - r * partition_numel, 0, partition_numel)."""
    paddings = paddings or [0] * len(params)
    alignment = NCCL_START_ALIGNMENT_FACTOR * partition_count if stage in (1, 2) else 1
    entries, offset = [], 0
    for (name, shape, dtype), padding in zip(params, paddings, strict=True):
        entry = tensor(name, shape, dtype)
        entry.update(offset=offset, padding=padding)
        entries.append(entry)
        offset += entry["numel"] + padding
    end = offset
    padded = -(-end // alignment) * alignment
    partition = padded // partition_count
    if tail_padding_saved:
        saved = [partition] * partition_count
    else:
        saved = [min(partition, max(0, end - r * partition)) for r in range(partition_count)]
    return {
        "optimizer_group": optimizer_group,
        "partitioning": "flat",
        "partition_count": partition_count,
        "alignment": alignment,
        "padded_numel": padded,
        "partition_numel": partition,
        "saved_numels": saved,
        "params": entries,
    }


def per_param_group(optimizer_group: int, params: list[tuple[str, list[int], str]], *, world_size: int) -> dict:
    """Stage 3: each param padded to a multiple of the world size, (-numel) mod ws; a rank
    holds (numel + padding) / ws elements of each, back to back; every rank saves the same."""
    entries, offset = [], 0
    for name, shape, dtype in params:
        entry = tensor(name, shape, dtype)
        padding = (-entry["numel"]) % world_size
        entry.update(offset=offset, padding=padding)
        entries.append(entry)
        offset += (entry["numel"] + padding) // world_size
    return {
        "optimizer_group": optimizer_group,
        "partitioning": "per_param",
        "partition_count": world_size,
        "alignment": 1,
        "padded_numel": offset * world_size,
        "partition_numel": offset,
        "saved_numels": [offset] * world_size,
        "params": entries,
    }


def _align(value: int) -> int:
    return -(-value // ZIP_ALIGN) * ZIP_ALIGN


def model_file(path: str, ranks: list[int], size: int = 7357) -> dict:
    return {"path": path, "role": "model_states", "ranks": ranks, "size": size, "partitions": []}


def optimizer_files(groups: list[dict], master_dtype: str, *, step: int, ranks_per_file: int = 1,
                    prefix: str = "bf16_zero_pp", shared_member: bool = False, tight: bool = False) -> list[dict]:
    """One optimizer-states file per ``ranks_per_file`` ranks, one locator per (group, rank).

    Separate members: each partition is its own tensor (element_offset 0, member exactly
    saved_numel * itemsize bytes). ``shared_member``: one member per rank holds all its
    partitions back to back (element_offset > 0, the last one ends exactly at the member's
    end). ``tight``: the file ends exactly where its last member ends.
    """
    itemsize = ITEMSIZE[master_dtype]
    world = groups[0]["partition_count"]
    files = []
    for first in range(0, world, ranks_per_file):
        ranks = list(range(first, min(world, first + ranks_per_file)))
        stem = f"{prefix}_rank_{ranks[0]}_mp_rank_00_optim_states"
        locators, data_offset, key = [], ZIP_HEADER, 3
        for rank in ranks:
            if shared_member:
                total = sum(g["saved_numels"][rank] for g in groups)
                member, element_offset = f"{stem}/data/{key}", 0
                for g, grp in enumerate(groups):
                    numel = grp["saved_numels"][rank]
                    locators.append(_locator(g, rank, member, data_offset, total * itemsize, master_dtype,
                                             element_offset, numel))
                    element_offset += numel
                data_offset = _align(data_offset + total * itemsize)
                key += 1
            else:
                for g, grp in enumerate(groups):
                    numel = grp["saved_numels"][rank]
                    locators.append(_locator(g, rank, f"{stem}/data/{key}", data_offset, numel * itemsize,
                                             master_dtype, 0, numel))
                    data_offset = _align(data_offset + numel * itemsize)
                    key += 1
        last = locators[-1]
        end = last["data_offset"] + last["member_size"]
        files.append({
            "path": f"global_step{step}/{stem}.pt",
            "role": "optimizer_states",
            "ranks": ranks,
            "size": end if tight else end + ZIP_TRAILER,
            "partitions": locators,
        })
    return files


def _locator(group, rank, member, data_offset, member_size, dtype, element_offset, numel) -> dict:
    return {
        "group": group, "rank": rank, "member": member, "data_offset": data_offset, "member_size": member_size,
        "dtype": dtype, "element_offset": element_offset, "numel": numel,
    }


def manifest(*, layout_: dict, groups: list[dict], frozen=(), buffers=(), aliases=(), excluded=(), files=(),
             producer_: dict | None = None, version: str = "1.0.0", **unknown) -> dict:
    doc = {
        "format": "ckptspec.manifest",
        "format_version": version,
        "producer": producer_ or producer(),
        "layout": layout_,
        "groups": groups,
        "frozen": list(frozen),
        "buffers": list(buffers),
        "aliases": list(aliases),
        "excluded": list(excluded),
        "files": list(files),
    }
    doc.update(unknown)
    return doc


def frozen_param(name, shape, dtype, stored_in) -> dict:
    entry = tensor(name, shape, dtype)
    entry["stored_in"] = stored_in
    return entry


def buffer(name, shape, dtype) -> dict:
    return {"name": name, "shape": list(shape), "dtype": dtype}


def alias(name, owner, shape) -> dict:
    return {"name": name, "owner": owner, "shape": list(shape)}


# --------------------------------------------------------------------------- the valid corpus

BF16, FP16, FP32 = "bfloat16", "float16", "float32"


def stage0_single_group_ws2() -> dict:
    """Stage 0 does not partition: one flat group, partition_count 1 (even with 2 ranks), alignment 1.
    DeepSpeed's fused FP16_Optimizer writes no optimizer files at stage 0: its flat fp32 master
    (``optimizer.fp32_groups_flat[0]``) is inside the model states, after the module's four tensors."""
    params = [("embed.weight", [10, 8], FP16), ("fc.weight", [4, 8], FP16), ("fc.bias", [4], FP16)]
    groups = [flat_group(0, params, stage=0, partition_count=1, tail_padding_saved=False)]
    model = model_file("global_step5/mp_rank_00_model_states.pt", [0])
    numel = groups[0]["saved_numels"][0]
    model["partitions"] = [_locator(0, 0, "mp_rank_00_model_states/data/4", 6400, numel * ITEMSIZE[FP32], FP32, 0,
                                    numel)]
    files = [model]
    return manifest(layout_=layout(0, 2, model_dtype=FP16, optimizer="FP16_Optimizer"), groups=groups,
                    buffers=[buffer("fc.num_batches_tracked", [], "int64")], files=files)


def stage1_fp16_ws3_tail_stripped() -> dict:
    """Stage 1, 3 ranks, three groups; tail padding stripped, so the last ranks save less
    (the one-element group: ranks 1 and 2 save nothing at all)."""
    decay = [("blocks.0.attn.weight", [20, 10], FP16), ("blocks.0.mlp.weight", [10, 7], FP16), ("head.bias", [3], FP16)]
    no_decay = [("blocks.0.ln.weight", [10], FP16), ("blocks.0.ln.bias", [7], FP16)]
    tiny = [("scale", [1], FP16)]
    groups = [
        flat_group(0, decay, stage=1, partition_count=3, tail_padding_saved=False),
        flat_group(1, no_decay, stage=1, partition_count=3, tail_padding_saved=False),
        flat_group(2, tiny, stage=1, partition_count=3, tail_padding_saved=False),
    ]
    files = [model_file("global_step30/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=30, prefix="zero_pp")
    return manifest(layout_=layout(1, 3, model_dtype=FP16, optimizer="DeepSpeedZeroOptimizer"), groups=groups,
                    files=files)


def stage1_bf16_tail_padding_saved() -> dict:
    """DeepSpeed's BF16_Optimizer saves whole partitions, tail padding included."""
    params = [("emb.weight", [50, 16], BF16), ("l1.weight", [33, 16], BF16), ("l1.bias", [33], BF16),
              ("l2.weight", [7, 33], BF16), ("l2.bias", [7], BF16)]
    groups = [flat_group(0, params, stage=1, partition_count=2, tail_padding_saved=True)]
    files = [model_file("global_step2/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=2)
    return manifest(layout_=layout(1, 2, tail_padding_saved=True, optimizer="BF16_Optimizer"), groups=groups,
                    aliases=[alias("head.weight", "emb.weight", [50, 16])], files=files)


def stage2_round_robin_ws4() -> dict:
    """Round-robin gradients (params listed in the optimizer's order), 4 ranks, two ranks per
    file; the second group ends early enough that rank 3 saves nothing."""
    params = [("layers.1.weight", [12, 12], BF16), ("layers.0.weight", [12, 12], BF16),
              ("layers.1.bias", [12], BF16), ("layers.0.bias", [12], BF16)]
    norms = [("norm.weight", [9], BF16), ("norm.bias", [8], BF16)]
    groups = [
        flat_group(0, params, stage=2, partition_count=4, tail_padding_saved=False),
        flat_group(1, norms, stage=2, partition_count=4, tail_padding_saved=False),
    ]
    files = [model_file("global_step40/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=40, ranks_per_file=2)
    return manifest(layout_=layout(2, 4, round_robin=True, optimizer="DeepSpeedZeroOptimizer"), groups=groups,
                    files=files)


def stage2_parameter_alignment() -> dict:
    """With parameter_alignment each param may carry padding: here [0, 0, 7, 1, 0]."""
    params = [("a.weight", [4, 4], FP16), ("b.weight", [3, 8], FP16), ("c.weight", [9], FP16),
              ("d.weight", [7], FP16), ("e.bias", [5], FP16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False, paddings=[0, 0, 7, 1, 0])]
    files = [model_file("global_step3/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=3, prefix="zero_pp")
    return manifest(layout_=layout(2, 2, model_dtype=FP16, parameter_alignment=True), groups=groups, files=files)


def stage3_two_subgroups_ws3() -> dict:
    """Stage 3: per-param partitioning; optimizer group 0 is split into two sub-groups (two
    group entries with optimizer_group 0). Includes a 0-d and a zero-size param. One member
    per rank holds all its partitions (element_offset > 0)."""
    sub_a = [("encoder.weight", [10, 10], BF16), ("encoder.bias", [7], BF16)]
    sub_b = [("decoder.weight", [4, 3], BF16)]
    other = [("temperature", [], BF16), ("unused.weight", [0, 8], BF16), ("out.bias", [5], BF16)]
    groups = [
        per_param_group(0, sub_a, world_size=3),
        per_param_group(0, sub_b, world_size=3),
        per_param_group(1, other, world_size=3),
    ]
    files = [model_file(f"global_step7/zero_pp_rank_{r}_mp_rank_00_model_states.pt", [r], 5000) for r in range(3)]
    files += optimizer_files(groups, FP32, step=7, shared_member=True)
    return manifest(layout_=layout(3, 3, optimizer="DeepSpeedZeroOptimizer_Stage3", sub_group_size=100),
                    groups=groups, files=files)


def world_size_1_stage2() -> dict:
    """One rank: alignment 2, and the single rank saves fewer elements than its padded partition."""
    params = [("w", [3, 5], BF16), ("b", [3], BF16), ("g", [1], BF16)]
    groups = [flat_group(0, params, stage=2, partition_count=1, tail_padding_saved=False)]
    files = [model_file("global_step1/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=1)
    return manifest(layout_=layout(2, 1), groups=groups, files=files)


def scalar_and_zero_size_tensors() -> dict:
    """0-d tensors (shape [], numel 1) and zero-size tensors (shape [0, 8], numel 0) everywhere."""
    params = [("scale", [], BF16), ("empty.weight", [0, 8], BF16), ("proj.weight", [6, 4], BF16),
              ("empty.bias", [0], BF16), ("shift", [], BF16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False)]
    files = [model_file("global_step9/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=9)
    return manifest(
        layout_=layout(2, 2), groups=groups,
        frozen=[frozen_param("frozen.scalar", [], BF16, "module"), frozen_param("frozen.empty", [3, 0, 2], BF16, "module")],
        buffers=[buffer("step", [], "int64"), buffer("mask", [0], "bool")],
        aliases=[alias("empty.weight.tied", "empty.weight", [0, 8]), alias("scale.tied", "scale", [])],
        files=files,
    )


def frozen_all_stored_in() -> dict:
    """Frozen params stored in the module state dict, in fragments, and in partitioned fragments."""
    params = [("adapter.down", [16, 4], BF16), ("adapter.up", [4, 16], BF16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False)]
    files = [model_file("global_step11/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=11)
    frozen = [
        frozen_param("base.embed.weight", [32, 16], BF16, "module"),
        frozen_param("base.layer.weight", [16, 16], BF16, "fragments"),
        frozen_param("base.layer.bias", [16], BF16, "partitioned_fragments"),
    ]
    return manifest(layout_=layout(2, 2, exclude_frozen_parameters=False), groups=groups, frozen=frozen,
                    aliases=[alias("base.lm_head.weight", "base.embed.weight", [32, 16])], files=files)


def aliases_buffers_excluded() -> dict:
    """Aliases (to a param and to a buffer), buffers, and params excluded from the checkpoint."""
    params = [("tok.weight", [20, 6], BF16), ("mix.weight", [6, 6], BF16), ("mix.bias", [6], BF16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False)]
    files = [model_file("global_step12/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=12)
    return manifest(
        layout_=layout(2, 2, exclude_frozen_parameters=True), groups=groups,
        buffers=[buffer("rope.inv_freq", [3], FP32), buffer("bn.running_mean", [6], FP32), buffer("bn.num_batches_tracked", [], "int64")],
        aliases=[alias("out.weight", "tok.weight", [20, 6]), alias("rope.inv_freq.shared", "rope.inv_freq", [3])],
        excluded=[{"name": "frozen.embed.weight", "reason": "frozen, and exclude_frozen_parameters is set"},
                  {"name": "lora.dropout_mask", "reason": "not part of the state dict"}],
        files=files,
    )


def files_with_hashes() -> dict:
    """Every file hashed (sha256 and blake2b); one member per rank; files end exactly at their last member."""
    params = [("w1", [8, 8], BF16), ("w2", [8, 3], BF16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False),
              flat_group(1, [("b1", [8], BF16), ("b2", [3], BF16)], stage=2, partition_count=2, tail_padding_saved=False)]
    files = [model_file("global_step13/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=13, shared_member=True, tight=True)
    for i, f in enumerate(files):
        data = f["path"].encode()
        if i % 2:
            f["hash"] = {"algorithm": "blake2b", "digest": hashlib.blake2b(data).hexdigest()}
        else:
            f["hash"] = {"algorithm": "sha256", "digest": hashlib.sha256(data).hexdigest()}
    return manifest(layout_=layout(2, 2), groups=groups, files=files)


def no_files() -> dict:
    """A manifest may describe the layout without listing any file."""
    params = [("w", [5, 5], BF16), ("b", [5], BF16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False)]
    return manifest(layout_=layout(2, 2), groups=groups)


def newer_minor_unknown_fields() -> dict:
    """Format 1.4.0 read by a 1.0 reader: valid with warning CK004, unknown fields tolerated."""
    doc = no_files()
    doc["format_version"] = "1.4.0"
    doc["layout"]["activation_checkpointing"] = {"partitioned": True}
    doc["groups"][0]["params"][0]["quantization"] = "none"
    doc["signatures"] = [{"key": "example", "value": "0" * 16}]
    return doc


def minimal_optional_absent() -> dict:
    """No optional field anywhere: no created/metadata, no model_parallel_size, optimizer,
    sub_group_size, exclude_frozen_parameters, no file hash."""
    params = [("w", [4, 7], FP16), ("b", [7], FP16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False)]
    files = [model_file("global_step4/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=4, prefix="zero_pp")
    prod = {k: v for k, v in producer().items() if k != "created"}
    return manifest(layout_=layout(2, 2, model_dtype=FP16), groups=groups, files=files, producer_=prod)


def integral_floats() -> dict:
    """Counts written with a zero fraction (16.0): a writer must not, but JSON Schema counts them
    as integers, so a reader must accept them (spec.md, counts)."""
    doc = no_files()
    grp = doc["groups"][0]
    for key in ("padded_numel", "partition_numel"):
        grp[key] = float(grp[key])
    grp["params"][1]["numel"] = float(grp["params"][1]["numel"])
    grp["params"][1]["offset"] = float(grp["params"][1]["offset"])
    doc["layout"]["world_size"] = 2.0
    return doc


def deepspeed_zero2_example() -> dict:
    """The manifest ckptspec writes for a real DeepSpeed ZeRO-2 bf16 checkpoint on 2 ranks."""
    return json.loads(EXAMPLE.read_text("utf-8"))


VALID_MANIFESTS = {
    "stage0-single-group-ws2": stage0_single_group_ws2,
    "stage1-fp16-ws3-tail-stripped": stage1_fp16_ws3_tail_stripped,
    "stage1-bf16-tail-padding-saved": stage1_bf16_tail_padding_saved,
    "stage2-round-robin-ws4": stage2_round_robin_ws4,
    "stage2-parameter-alignment-paddings": stage2_parameter_alignment,
    "stage3-per-param-two-subgroups-ws3": stage3_two_subgroups_ws3,
    "world-size-1-stage2": world_size_1_stage2,
    "scalar-and-zero-size-tensors": scalar_and_zero_size_tensors,
    "frozen-all-stored-in-kinds": frozen_all_stored_in,
    "aliases-buffers-excluded": aliases_buffers_excluded,
    "files-with-hashes": files_with_hashes,
    "no-files": no_files,
    "newer-minor-1.4.0-unknown-fields": newer_minor_unknown_fields,
    "minimal-optional-fields-absent": minimal_optional_absent,
    "integral-float-counts": integral_floats,
    "deepspeed-zero2-bf16-2ranks": deepspeed_zero2_example,
}


# --------------------------------------------------------------------------- format 1.1
#
# A 1.1 manifest adds OPTIONAL fields to 1.0 (docs/spec.md): byte locators of every other tensor
# of the files (frozen parameters and buffers by name, each flat group's low-precision weights,
# each rank's partition of each per-element optimizer state), the optimizer's per-group
# scalars, the save's counters and id, per-tensor digests and the byte order. The builders
# below place every tensor in fake torch zip files (members back to back, each aligned to 64
# bytes) and derive every locator from the rules of docs/spec.md.

V11 = "1.1.0"
ADAMW = "torch.optim.adamw.AdamW"
MOMENTS = ("exp_avg", "exp_avg_sq")


class Archive:
    """A fake torch zip file: members from ZIP_HEADER on, back to back, each aligned to 64 bytes."""

    def __init__(self, path: str):
        self.stem = path.rsplit("/", 1)[-1].removesuffix(".pt")
        self.key, self.offset = 0, ZIP_HEADER

    def locate(self, dtype: str, numel: int, storage_numel: int | None = None, **head) -> dict:
        """A locator of ``numel`` elements at the start of a new member of ``storage_numel`` elements."""
        nbytes = (numel if storage_numel is None else storage_numel) * ITEMSIZE[dtype]
        loc = {**head, "member": f"{self.stem}/data/{self.key}", "data_offset": self.offset, "member_size": nbytes,
               "dtype": dtype, "element_offset": 0, "numel": numel}
        self.key += 1
        self.offset = _align(self.offset + nbytes)
        return loc

    @property
    def size(self) -> int:
        return self.offset + ZIP_TRAILER


def digest(*parts) -> dict:
    """A stand-in digest: the corpus has no tensor bytes, only well-formed digests."""
    return {"sha256": hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()}


def share(numel: int, world_size: int, rank: int) -> int:
    """The real elements of rank ``rank``'s stage-3 fragment: ceil(numel / ws), less at the end."""
    part = -(-numel // world_size)
    return max(0, min(part, numel - rank * part))


def adamw(lr=0.01, weight_decay=0.01, **extra) -> dict:
    hp = {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": weight_decay, "amsgrad": False,
          "maximize": False, "capturable": False, "differentiable": False, "decoupled_weight_decay": True}
    hp.update(extra)
    return hp


def v11_manifest(*, layout_: dict, groups: list[dict], frozen=(), buffers=(), aliases=(), excluded=(), step: int = 2,
                 states=MOMENTS, hyper: list[dict] | None = None, loss_scaler: dict | None = None,
                 clip_grad: float | None = 1.0, save_id: str | None = "5f0c8a4e-2b1d-4c3e-9a7f-1d2e3f405162",
                 optimizer_class: str = ADAMW, digests: bool = True, prefix: str = "bf16_zero_pp") -> dict:
    """A complete 1.1 manifest: files with every locator, the optimizer, the save, digests."""
    stage, world = layout_["zero_stage"], layout_["world_size"]
    model_dtype, master_dtype = layout_["model_dtype"], layout_["master_dtype"]
    layout_ = {**layout_, "byte_order": "little"}
    frozen, buffers = list(frozen), list(buffers)
    tag = f"global_step{step}"
    files = []
    # Model states: stage 0-2 one file (rank 0): flat lp weights, whole frozen params, buffers;
    # stage 3 one per rank: this rank's fragment of each frozen param, buffers in rank 0's only.
    for rank in range(world if stage == 3 else 1):
        path = f"{tag}/zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else f"{tag}/mp_rank_00_model_states.pt"
        zf = Archive(path)
        entry = {"path": path, "role": "model_states", "ranks": [rank], "size": 0, "partitions": [], "tensors": []}
        if stage < 3:
            entry["model_weights"] = [zf.locate(model_dtype, g["padded_numel"], group=i) for i, g in enumerate(groups)]
        for f in frozen:
            if f["stored_in"] == "partitioned_fragments":
                part = -(-f["numel"] // world)
                entry["tensors"].append(zf.locate(f["dtype"], share(f["numel"], world, rank), part, name=f["name"]))
            elif rank == 0:
                entry["tensors"].append(zf.locate(f["dtype"], f["numel"], name=f["name"]))
        if rank == 0:
            entry["tensors"] += [zf.locate(b["dtype"], math.prod(b["shape"]), name=b["name"]) for b in buffers]
        entry["size"] = zf.size
        files.append(entry)
    # Optimizer states, one file per rank: per group, each per-element state (the whole partition,
    # padding kept) and the master partition (a view of saved_numels[rank] elements).
    for rank in range(world):
        path = f"{tag}/{prefix}_rank_{rank}_mp_rank_00_optim_states.pt"
        zf = Archive(path)
        entry = {"path": path, "role": "optimizer_states", "ranks": [rank], "size": 0, "partitions": [],
                 "state_partitions": []}
        for g, grp in enumerate(groups):
            for key in states:
                entry["state_partitions"].append(
                    zf.locate(FP32, grp["partition_numel"], group=g, rank=rank, state=key))
        for g, grp in enumerate(groups):
            entry["partitions"].append(
                zf.locate(master_dtype, grp["saved_numels"][rank], grp["partition_numel"], group=g, rank=rank))
        # the 1.0 locator's key order: group, rank, member, data_offset, member_size, dtype, element_offset, numel
        entry["size"] = zf.size
        files.append(entry)
    optimizer_groups = sorted({g["optimizer_group"] for g in groups})
    hyper = hyper or [adamw() for _ in optimizer_groups]
    optimizer = {"class": optimizer_class,
                 "groups": [{"optimizer_group": og, "hyperparameters": hp, "step": float(step)}
                            for og, hp in zip(optimizer_groups, hyper)]}
    if loss_scaler is not None:
        optimizer["loss_scaler"] = loss_scaler
    if clip_grad is not None:
        optimizer["clip_grad"] = clip_grad
    save = {"global_steps": step, "global_samples": 8 * step, "skipped_steps": 0}
    if save_id is not None:
        save["id"] = save_id
    if digests:
        for g, grp in enumerate(groups):
            for p in grp["params"]:
                p["digest"] = digest(p["name"], "master")
                if stage < 3:
                    p["model_digest"] = digest(p["name"], "model")
                if states:
                    p["state_digests"] = {key: digest(p["name"], key) for key in states}
        for t in frozen + buffers:
            t["digest"] = digest(t["name"])
    return manifest(layout_=layout_, groups=groups, frozen=frozen, buffers=buffers, aliases=aliases,
                    excluded=excluded, files=files, version=V11, optimizer=optimizer, save=save)


def scaler(dynamic: bool = False) -> dict:
    if not dynamic:
        return {"kind": "LossScaler", "state": {"cur_scale": 1.0, "dynamic": False}}
    return {"kind": "DynamicLossScaler", "state": {
        "cur_scale": 16, "dynamic": True, "cur_iter": 2, "last_overflow_iter": -1, "scale_factor": 2.0,
        "scale_window": 1000, "min_scale": 1, "delayed_shift": 2, "cur_hysteresis": 2,
        "consecutive_hysteresis": False, "raise_error_at_min_scale": True, "dtype": "float16"}}


TINY = [("emb.weight", [50, 16], BF16), ("l1.weight", [33, 16], BF16), ("l1.bias", [33], BF16),
        ("l2.weight", [16, 33], BF16), ("l2.bias", [16], BF16)]


def v11_stage2_complete() -> dict:
    """Stage 2, 2 ranks: the tiny model of the tests, with every 1.1 field: frozen params in
    fragments, buffers, a tie, the flat bf16 weights, Adam's moments, the loss scaler, a save id."""
    groups = [flat_group(0, TINY, stage=2, partition_count=2, tail_padding_saved=False)]
    return v11_manifest(
        layout_=layout(2, 2, optimizer="DeepSpeedZeroOptimizer", exclude_frozen_parameters=False), groups=groups,
        frozen=[frozen_param("frozen.weight", [16, 16], BF16, "fragments"), frozen_param("frozen.bias", [16], BF16, "fragments")],
        buffers=[buffer("step_count", [], "int64"), buffer("running", [16], FP32)],
        aliases=[alias("head.weight", "emb.weight", [50, 16])], loss_scaler=scaler())


def v11_stage1_two_groups_dynamic_scaler() -> dict:
    """Stage 1, fp16, 3 ranks, two optimizer groups with their own weight decay, a dynamic loss
    scaler (an integer scale, a dtype), frozen params in the module state dict."""
    weights = [("emb.weight", [50, 16], FP16), ("l1.weight", [33, 16], FP16), ("l2.weight", [16, 33], FP16)]
    biases = [("l1.bias", [33], FP16), ("l2.bias", [16], FP16)]
    groups = [flat_group(0, weights, stage=1, partition_count=3, tail_padding_saved=False),
              flat_group(1, biases, stage=1, partition_count=3, tail_padding_saved=False)]
    return v11_manifest(
        layout_=layout(1, 3, model_dtype=FP16, optimizer="DeepSpeedZeroOptimizer"), groups=groups,
        frozen=[frozen_param("frozen.weight", [16, 16], FP16, "module")],
        buffers=[buffer("running", [16], FP32)], hyper=[adamw(), adamw(weight_decay=0.0)],
        loss_scaler=scaler(dynamic=True), step=7, prefix="fp16_zero_pp")


def v11_bf16_optimizer() -> dict:
    """BF16_Optimizer (stage 1): whole partitions saved, no loss scaler, gradient clipping."""
    groups = [flat_group(0, TINY, stage=1, partition_count=2, tail_padding_saved=True)]
    return v11_manifest(layout_=layout(1, 2, tail_padding_saved=True, optimizer="BF16_Optimizer"), groups=groups,
                        aliases=[alias("head.weight", "emb.weight", [50, 16])], clip_grad=0.5)


def v11_stage3_fragments() -> dict:
    """Stage 3, 3 ranks, two sub-groups of one optimizer group and a second group: frozen params
    in per-rank fragments (rank 2 holds no real element of `tiny`), buffers in rank 0's file."""
    groups = [per_param_group(0, [("emb.weight", [50, 16], BF16), ("l1.weight", [33, 16], BF16)], world_size=3),
              per_param_group(0, [("l2.weight", [16, 33], BF16)], world_size=3),
              per_param_group(1, [("l1.bias", [33], BF16), ("l2.bias", [16], BF16)], world_size=3)]
    return v11_manifest(
        layout_=layout(3, 3, optimizer="DeepSpeedZeroOptimizer_Stage3", sub_group_size=1000), groups=groups,
        frozen=[frozen_param("pos.weight", [2, 5], BF16, "partitioned_fragments"),
                frozen_param("tiny", [2], BF16, "partitioned_fragments")],
        buffers=[buffer("step_count", [], "int64")], aliases=[alias("head.weight", "emb.weight", [50, 16])],
        hyper=[adamw(), adamw(weight_decay=0.0)], loss_scaler=scaler(), clip_grad=None)


def v11_alignment_amsgrad() -> dict:
    """parameter_alignment paddings, and a third per-element state (AMSGrad's max_exp_avg_sq):
    state names are whatever the optimizer keeps, never an enumeration."""
    params = [("a.weight", [4, 4], FP16), ("b.weight", [3, 8], FP16), ("c.weight", [9], FP16),
              ("d.weight", [7], FP16), ("e.bias", [5], FP16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False, paddings=[0, 0, 7, 1, 0])]
    return v11_manifest(layout_=layout(2, 2, model_dtype=FP16, parameter_alignment=True), groups=groups,
                        states=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), hyper=[adamw(amsgrad=True)],
                        loss_scaler=scaler(dynamic=True), prefix="zero_pp")


def v11_zero_size_located() -> dict:
    """0-d and zero-size tensors located: a zero-element frozen param has a 0-byte locator."""
    params = [("scale", [], BF16), ("proj.weight", [6, 4], BF16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False)]
    return v11_manifest(layout_=layout(2, 2), groups=groups,
                        frozen=[frozen_param("z1.weight", [0, 8], BF16, "fragments"), frozen_param("z2", [0], BF16, "fragments")],
                        buffers=[buffer("step", [], "int64"), buffer("mask", [0], "bool")], loss_scaler=scaler())


def v11_layout_only() -> dict:
    """What the live engine writes before anything is saved: no files, but the optimizer (with its
    class, which only the engine knows), the counters and the save id."""
    doc = v11_stage2_complete()
    doc["files"] = []
    for grp in doc["groups"]:
        for p in grp["params"]:
            for key in ("digest", "model_digest", "state_digests"):
                p.pop(key)
    for t in doc["frozen"] + doc["buffers"]:
        t.pop("digest")
    return doc


def v11_no_new_fields() -> dict:
    """A 1.1 manifest may hold none of 1.1's fields (a 1.0 manifest migrated without its checkpoint)."""
    doc = stage2_parameter_alignment()
    doc["format_version"] = V11
    return doc


def v11_without_states() -> dict:
    """An optimizer without per-element state (SGD without momentum): no state partitions, no state
    digests; the weights, frozen params and buffers are still located. No save id, no clipping."""
    groups = [flat_group(0, TINY, stage=2, partition_count=2, tail_padding_saved=False)]
    return v11_manifest(layout_=layout(2, 2), groups=groups, states=(), save_id=None, clip_grad=None,
                        frozen=[frozen_param("frozen.weight", [16, 16], BF16, "fragments")],
                        hyper=[{"lr": 0.1, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}],
                        optimizer_class="torch.optim.sgd.SGD", loss_scaler=scaler())


def v11_no_digests() -> dict:
    """Generated without --hash: no digest anywhere, everything else located."""
    return v11_manifest(layout_=layout(2, 2), groups=[flat_group(0, TINY, stage=2, partition_count=2,
                        tail_padding_saved=False)], buffers=[buffer("running", [16], FP32)], digests=False,
                        loss_scaler=scaler())


def v11_newer_minor() -> dict:
    """Format 1.5.0 read by a 1.1 reader: valid with warning CK004. Unknown fields are tolerated:
    a digest of an algorithm this reader does not know (and no sha256), an unknown locator kind,
    an unknown optimizer field."""
    doc = v11_stage2_complete()
    doc["format_version"] = "1.5.0"
    doc["frozen"][0]["digest"] = {"blake3": "ab" * 32}
    doc["files"][0]["quantized_weights"] = [{"group": 0, "scheme": "int8"}]
    doc["optimizer"]["scheduler"] = {"name": "cosine", "last_epoch": 2}
    return doc


def v11_deepspeed_example() -> dict:
    """The 1.1 manifest of the real DeepSpeed ZeRO-2 bf16 checkpoint committed to the repository
    (`ckptspec migrate` of the 1.0 example, filled from the checkpoint)."""
    return json.loads(EXAMPLE_1_1.read_text("utf-8"))


VALID_1_1 = {
    "stage2-bf16-ws2-complete": v11_stage2_complete,
    "stage1-fp16-ws3-two-groups-dynamic-scaler": v11_stage1_two_groups_dynamic_scaler,
    "stage1-bf16-optimizer-whole-partitions": v11_bf16_optimizer,
    "stage3-fragments-subgroups-ws3": v11_stage3_fragments,
    "stage2-alignment-amsgrad-three-states": v11_alignment_amsgrad,
    "zero-size-tensors-located": v11_zero_size_located,
    "layout-only-live-engine": v11_layout_only,
    "no-1.1-fields": v11_no_new_fields,
    "optimizer-without-per-element-state": v11_without_states,
    "no-digests": v11_no_digests,
    "newer-minor-1.5.0-unknown-fields": v11_newer_minor,
    "deepspeed-zero2-bf16-2ranks": v11_deepspeed_example,
}

# The invalid files: one edit of one valid file each, and the codes it must produce.
# (name, base, edit, codes, warnings, what is wrong)
S2, S1, S3, AMS = ("stage2-bf16-ws2-complete", "stage1-fp16-ws3-two-groups-dynamic-scaler",
                   "stage3-fragments-subgroups-ws3", "stage2-alignment-amsgrad-three-states")


def _set(path: str, value):
    """An edit that sets the value at a dotted path ("files.0.tensors.1.numel")."""
    def edit(doc):
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        target = doc
        for part in parents:
            target = target[part]
        target[last] = value
    return edit


def _pop(path: str):
    def edit(doc):
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        target = doc
        for part in parents:
            target = target[part]
        target.pop(last)
    return edit


def _edits(*edits):
    def edit(doc):
        for e in edits:
            e(doc)
    return edit


def _append(path: str, make):
    def edit(doc):
        target = doc
        for part in [int(p) if p.isdigit() else p for p in path.split(".")]:
            target = target[part]
        target.append(make(doc))
    return edit


def _move(path: str, to: str):
    """An edit that moves the locator at ``path`` to the end of the list at ``to`` (created if need be)."""
    def edit(doc):
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        source = doc
        for part in parents:
            source = source[part]
        item = source.pop(last)
        *parents, last = [int(p) if p.isdigit() else p for p in to.split(".")]
        target = doc
        for part in parents:
            target = target[part]
        target.setdefault(last, []).append(item)
    return edit


def _copy_of(path: str, **changes):
    """A copy of the locator at ``path``, changed."""
    def make(doc):
        target = doc
        for part in [int(p) if p.isdigit() else p for p in path.split(".")]:
            target = target[part]
        return {**target, **changes}
    return make


INVALID_1_1 = [
    # CK001: the schema of 1.1
    ("CK001-schema-byte-order-big", S2, _set("layout.byte_order", "big"), ["CK001"], "byte_order has the one value little"),
    ("CK001-schema-digest-uppercase", S2, _set("frozen.0.digest.sha256", "AB" * 32), ["CK001"], "a digest is lower-case hex"),
    ("CK001-schema-digest-short", S2, _set("buffers.1.digest.sha256", "ab" * 16), ["CK001"], "a sha256 digest has 64 digits"),
    ("CK001-schema-digest-empty", S2, _set("groups.0.params.0.digest", {}), ["CK001"], "a digest names at least one algorithm"),
    ("CK001-schema-digest-unknown-algorithm", S2, _set("frozen.0.digest", {"sha256": "ab" * 32, "md5": "ab" * 16}), ["CK001"],
     "a 1.1 document's digest knows sha256 only"),
    ("CK001-schema-state-digest-empty-name", S2, _set("groups.0.params.1.state_digests", {"": {"sha256": "ab" * 32}}), ["CK001"],
     "a state has a name"),
    ("CK001-schema-tensor-locator-missing-numel", S2, _pop("files.0.tensors.0.numel"), ["CK001"], "a locator states its numel"),
    ("CK001-schema-state-locator-unknown-field", S2, _set("files.1.state_partitions.0.quantized", True), ["CK001"],
     "a 1.1 state locator has no other fields"),
    ("CK001-schema-model-weights-not-array", S2, _set("files.0.model_weights", {"group": 0}), ["CK001"], "model_weights is an array"),
    ("CK001-schema-optimizer-missing-class", S2, _pop("optimizer.class"), ["CK001"], "the optimizer names its class"),
    ("CK001-schema-step-negative", S2, _set("optimizer.groups.0.step", -1), ["CK001"], "a step is not negative"),
    ("CK001-schema-step-string", S2, _set("optimizer.groups.0.step", "2"), ["CK001"], "a step is a number"),
    ("CK001-schema-hyperparameter-null", S2, _set("optimizer.groups.0.hyperparameters.foreach", None), ["CK001"],
     "a hyperparameter is never null: a writer leaves unset (None) settings out"),
    ("CK001-schema-hyperparameter-object", S2, _set("optimizer.groups.0.hyperparameters.schedule", {"warmup": 10}), ["CK001"],
     "a hyperparameter is a number, boolean, string or a list of those"),
    ("CK001-schema-hyperparameter-nested-list", S2, _set("optimizer.groups.0.hyperparameters.betas", [[0.9], [0.999]]),
     ["CK001"], "lists of lists are not plain values"),
    ("CK001-schema-loss-scaler-missing-state", S2, _pop("optimizer.loss_scaler.state"), ["CK001"], "a loss scaler has its state"),
    ("CK001-schema-clip-grad-negative", S2, _set("optimizer.clip_grad", -1.0), ["CK001"], "gradient clipping is not negative"),
    ("CK001-schema-save-id-empty", S2, _set("save.id", ""), ["CK001"], "a save id is not empty"),
    ("CK001-schema-save-missing-counter", S2, _pop("save.skipped_steps"), ["CK001"], "the save has all three counters"),
    ("CK001-schema-1.0-document-with-1.1-field", "no-1.1-fields",
     _edits(_set("format_version", "1.0.0"), _set("save", {"global_steps": 3, "global_samples": 24, "skipped_steps": 0})),
     ["CK001"], "a 1.0 document may not carry a 1.1 field: it is checked against the 1.0 schema"),
    # CK115: group and rank ranges of the new locators
    ("CK115-state-partition-group-out-of-range", S2,
     _append("files.1.state_partitions", _copy_of("files.1.state_partitions.1", group=1)), ["CK115"],
     "a state partition of a group that does not exist"),
    ("CK115-state-partition-rank-not-in-file", S2, _set("files.2.state_partitions.0.rank", 0), ["CK115", "CK124"],
     "rank 0's state partition in rank 1's file (rank 0 then holds exp_avg twice, rank 1 lacks it: CK124)"),
    ("CK115-model-weights-group-out-of-range", S2, _set("files.0.model_weights.0.group", 3), ["CK115"],
     "flat weights of a group that does not exist"),
    # CK118, CK119: every kind of locator fits its member and its file
    ("CK118-tensor-locator-past-member", S2, _set("files.0.tensors.1.element_offset", 1), ["CK118"],
     "a frozen param's elements start one element late and end past their member"),
    ("CK118-state-partition-past-member", S2, _set("files.2.state_partitions.1.member_size", 3812), ["CK118"],
     "a state partition's member is one element too short"),
    ("CK118-model-weights-past-member", S2, _set("files.0.model_weights.0.element_offset", 2), ["CK118"],
     "the flat weights start two elements into their member"),
    ("CK119-tensor-locator-past-file", S3, _set("files.1.size", 1089), ["CK119"],
     "rank 1's model-states file ends one byte into its fragment of tiny"),
    ("CK119-state-partition-past-file", S2, _set("files.1.state_partitions.0.data_offset", 10_000_000), ["CK119"],
     "a state partition's member starts past the end of its file"),
    # CK120: what a locator may locate, and where
    ("CK120-tensor-locator-names-trainable", S2, _set("files.0.tensors.0.name", "l1.weight"), ["CK120", "CK121"],
     "a named locator for a trainable param (which partitions locate); frozen.weight is then not located (CK121)"),
    ("CK120-tensor-locator-names-alias", S2, _append("files.0.tensors", _copy_of("files.0.tensors.0", name="head.weight")),
     ["CK120"], "a tied alias is located through its owner"),
    ("CK120-tensors-in-optimizer-file", S2, _move("files.0.tensors.0", "files.1.tensors"), ["CK120"],
     "frozen.weight located in an optimizer-states file, which holds no named tensors"),
    ("CK120-state-partitions-in-model-file", S2, _move("files.1.state_partitions.0", "files.0.state_partitions"), ["CK120"],
     "rank 0's exp_avg located in the model-states file, which holds no optimizer state"),
    # CK121: every frozen param and buffer located as stored
    ("CK121-buffer-not-located", S2, _pop("files.0.tensors.3"), ["CK121"], "the running buffer has no locator"),
    ("CK121-frozen-located-twice", S2, _append("files.0.tensors", _copy_of("files.0.tensors.1")), ["CK121"],
     "frozen.bias is located twice"),
    ("CK121-fragment-of-rank-missing", S3, _pop("files.2.tensors.1"), ["CK121"], "rank 2's fragment of tiny is not located"),
    ("CK121-fragment-twice-in-one-rank", S3, _append("files.1.tensors", _copy_of("files.1.tensors.0")), ["CK121"],
     "rank 1's file locates its fragment of pos.weight twice"),
    # CK122: a named locator holds the tensor's real elements in its dtype
    ("CK122-frozen-locator-numel", S2, _set("files.0.tensors.0.numel", 255), ["CK122"], "frozen.weight is 256 elements, not 255"),
    ("CK122-fragment-numel-includes-padding", S3, _set("files.2.tensors.0.numel", 4), ["CK122"],
     "rank 2's fragment of pos.weight (10 elements over 3 ranks) holds 2 real elements; 4 counts its padding"),
    ("CK122-buffer-locator-dtype", S2, _set("files.0.tensors.2.dtype", "int32"), ["CK122"],
     "the step_count buffer is int64 (its member still fits)"),
    # CK123: the flat low-precision weights
    ("CK123-model-weights-numel-unpadded", S2, _set("files.0.model_weights.0.numel", 1905), ["CK123"],
     "the flat weights are the whole padded group (1908), not its real end"),
    ("CK123-model-weights-dtype", S2, _set("files.0.model_weights.0.dtype", FP16), ["CK123"],
     "the flat weights hold the model dtype, bfloat16, not float16 (same size: the member still fits)"),
    ("CK123-model-weights-twice", S2, _append("files.0.model_weights", _copy_of("files.0.model_weights.0")), ["CK123"],
     "group 0's flat weights are located twice"),
    ("CK123-model-weights-of-per-param-group", S3, _set("files.0.model_weights", [{"group": 0, "member": "x/data/99",
     "data_offset": 1024, "member_size": 0, "dtype": BF16, "element_offset": 0, "numel": 0}]), ["CK123"],
     "stage 3 saves no flat low-precision weights"),
    # CK124: optimizer state partitions cover every rank of a group
    ("CK124-state-missing-on-a-rank", S2, _pop("files.2.state_partitions.1"), ["CK124"],
     "rank 1 has no exp_avg_sq partition, rank 0 has"),
    ("CK124-state-located-twice", AMS, _append("files.1.state_partitions", _copy_of("files.1.state_partitions.2")),
     ["CK124"], "rank 0's max_exp_avg_sq is located twice"),
    # CK125: state partitions keep the whole partition
    ("CK125-state-numel-is-saved-numel", S2, _set("files.2.state_partitions.0.numel", 951), ["CK125"],
     "rank 1's exp_avg records the master's 951 saved elements; DeepSpeed keeps all 954"),
    ("CK125-state-numel-stage3", S3, _set("files.3.state_partitions.2.numel", 1), ["CK125"],
     "a stage-3 sub-group's state partition is its partition_numel on every rank"),
    # CK126: optimizer.groups and the manifest's optimizer groups
    ("CK126-optimizer-group-missing", S1, _pop("optimizer.groups.1"), ["CK126"], "optimizer group 1 is not described"),
    ("CK126-optimizer-group-unknown", S2, _set("optimizer.groups.0.optimizer_group", 4), ["CK126"],
     "optimizer group 4 holds none of the groups (and group 0 is then undescribed)"),
    ("CK126-optimizer-group-twice", S1, _set("optimizer.groups.1.optimizer_group", 0), ["CK126"],
     "optimizer group 0 described twice, group 1 not at all"),
    # 1.0 rules apply to 1.1 documents, and 1.1 rules to newer minors
    ("CK117-locator-numel-in-1.1", S2, _set("files.2.partitions.0.numel", 954), ["CK117"],
     "the 1.0 rules hold in 1.1: rank 1's master locator records its storage's 954 elements, not its 951"),
    ("CK122-newer-minor-still-checked", "newer-minor-1.5.0-unknown-fields", _set("files.0.tensors.0.numel", 1), ["CK122"],
     "a 1.5.0 document: unknown fields tolerated (CK004), 1.1's rules still apply"),
]


def corpus_1_1() -> dict[Path, str]:
    """Path -> text of every file of the 1.1 corpus, expected.json included."""
    out, expected, docs = {}, {}, {}
    for name, build in VALID_1_1.items():
        docs[name] = build()
        rel = f"valid/{name}.json"
        out[CORPUS_1_1 / rel] = render(docs[name])
        expected[rel] = {"valid": True, "codes": [], "warnings": ["CK004"] if name.startswith("newer-minor") else [],
                         "description": (build.__doc__ or "").split("\n\n")[0].replace("\n", " ").strip()}
    for name, base, edit, codes, description in INVALID_1_1:
        doc = json.loads(render(docs[base]))
        edit(doc)
        rel = f"invalid/{name}.json"
        out[CORPUS_1_1 / rel] = render(doc)
        expected[rel] = {"valid": False, "codes": sorted(codes), "warnings": ["CK004"] if base.startswith("newer-minor") else [],
                         "description": f"{description} (from valid/{base}.json)"}
    for rel in MSGPACK_1_1:
        expected[rel.replace(".json", ".msgpack")] = dict(expected[rel])
    out[CORPUS_1_1 / "expected.json"] = json.dumps(dict(sorted(expected.items())), indent=2, ensure_ascii=False) + "\n"
    return out


# msgpack twins (tests/conformance/make_msgpack.py writes them).
MSGPACK_1_1 = ["valid/stage3-fragments-subgroups-ws3.json", "invalid/CK125-state-numel-is-saved-numel.json"]


def render(doc) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def generated() -> dict[Path, str]:
    """Path -> text of every generated corpus file."""
    out = {VALID / f"{name}.json": render(build()) for name, build in VALID_MANIFESTS.items()}
    out.update(corpus_1_1())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the committed files")
    args = parser.parse_args(argv)
    stale = []
    for path, text in generated().items():
        if path.exists() and path.read_text("utf-8") == text:
            continue
        stale.append(path.relative_to(HERE).as_posix())
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, "utf-8")
    if args.check and stale:
        print("out of date: " + ", ".join(stale), file=sys.stderr)
        return 1
    if not args.check:
        print(f"wrote {len(stale)} file(s) in {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Corruptions of real DeepSpeed checkpoints, built programmatically.

Each fault takes a *copy* of a saved checkpoint (a save directory with ``latest`` and the
tag directory, from tests/_harness) and mutates it in place. Pickles are edited with
``torch.load(weights_only=False)`` + ``torch.save`` here, in test code only; ckptspec itself
never unpickles with torch.

Used by tests/deepspeed/test_shards.py (ckptspec must report ``code``, naming ``file``) and by
benchmarks/zero_to_fp32_vs_ckptspec.py (what DeepSpeed's zero_to_fp32 does with each).
"""

from __future__ import annotations

import collections
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The model of tests/_harness/job/model.py, in its natural parameter order.
NATURAL_ORDER = ["emb.weight", "l1.weight", "l1.bias", "l2.weight", "l2.bias"]


@dataclass(frozen=True)
class FaultEnv:
    donor: Path | None  # save directory of the donor checkpoint, if the fault uses one
    marker: Path  # a file the malicious pickle creates when it is unpickled (outside the checkpoint)


@dataclass(frozen=True)
class Fault:
    name: str
    base: str  # the checkpoint to corrupt: a MATRIX name, or committed:<name> (see base_dir)
    description: str  # one line for docs/validation.md
    code: str  # the code ckptspec must report
    file: str | None  # the file that finding must name (relative to the tag directory)
    mutate: Callable[[Path, FaultEnv], None]
    donor: str | None = None  # the checkpoint whose files the mutation copies in (as base)
    hashed_manifest: bool = False  # validate against a `generate --hash` manifest made before the corruption
    severity: str = "error"  # "warning": reported, but the checkpoint stays valid and readable
    digests_only: bool = False  # ... with the files' hashes removed: only its tensor digests can tell (format 1.1)
    reads_data: bool = False  # found where the files' data is read (validate, reconstruct); not by --no-hash, inspect


def base_dir(base: str, ds) -> Path:
    """The save directory a fault's ``base`` (or ``donor``) names: ``committed:<name>`` is a real
    checkpoint committed to the repository (no DeepSpeed, no job); any other name is a MATRIX
    checkpoint of the harness, built on first use (``ds`` is the harness, called only then)."""
    if base.startswith("committed:"):
        from .scenarios import COMMITTED

        return COMMITTED[base.removeprefix("committed:")]
    return ds().path(base)


def tag_dir(save_dir: Path) -> Path:
    return save_dir / (save_dir / "latest").read_text().strip()


def _optim(save_dir: Path, rank: int) -> Path:
    return next(tag_dir(save_dir).glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))


def _model(save_dir: Path, rank: int = 0) -> Path:
    found = list(tag_dir(save_dir).glob(f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
    return found[0] if found else tag_dir(save_dir) / "mp_rank_00_model_states.pt"


def _edit(path: Path, change: Callable[[dict], None]) -> None:
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)
    change(state)
    torch.save(state, path)  # same name, so the archive name inside the zip stays right


class _Evil:
    """Pickles as a call to Path.touch(marker): unpickling it runs code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


# --------------------------------------------------------------------------- mutations


def transpose_shape(save_dir: Path, env: FaultEnv) -> None:
    import torch

    def change(state):
        shapes = state["param_shapes"][0]
        shapes["l2.weight"] = torch.Size(reversed(shapes["l2.weight"]))

    _edit(_model(save_dir), change)


def empty_shared_params(save_dir: Path, env: FaultEnv) -> None:
    _edit(_model(save_dir, 0), lambda state: state.__setitem__("shared_params", {}))


def reorder_param_shapes(save_dir: Path, env: FaultEnv) -> None:
    def change(state):
        shapes = state["param_shapes"][0]
        names = list(shapes)
        i, j = names.index("l1.weight"), names.index("l2.weight")
        names[i], names[j] = names[j], names[i]
        state["param_shapes"][0] = collections.OrderedDict((n, shapes[n]) for n in names)

    _edit(_model(save_dir), change)


def reorder_rank1_param_shapes(save_dir: Path, env: FaultEnv) -> None:
    """Stage 3: only rank 1's copy of param_shapes reordered (zero_to_fp32 reads rank 0's)."""

    def change(state):
        shapes = state["param_shapes"][1]
        names = list(shapes)
        names[0], names[-1] = names[-1], names[0]
        state["param_shapes"][1] = collections.OrderedDict((n, shapes[n]) for n in names)

    _edit(_model(save_dir, 1), change)


def natural_order_param_shapes(save_dir: Path, env: FaultEnv) -> None:
    """A round-robin checkpoint whose param_shapes is written in natural order (DeepSpeed #1165)."""

    def change(state):
        shapes = state["param_shapes"][0]
        state["param_shapes"][0] = collections.OrderedDict((n, shapes[n]) for n in NATURAL_ORDER)

    _edit(_model(save_dir), change)


def delete_optim_rank1(save_dir: Path, env: FaultEnv) -> None:
    _optim(save_dir, 1).unlink()


def add_stale_rank2(save_dir: Path, env: FaultEnv) -> None:
    source = _optim(env.donor, 2)
    shutil.copyfile(source, tag_dir(save_dir) / source.name)


def truncate_optim_rank1(save_dir: Path, env: FaultEnv) -> None:
    path = _optim(save_dir, 1)
    os.truncate(path, path.stat().st_size // 2)


def cut_optim_rank1_tail(save_dir: Path, env: FaultEnv) -> None:
    path = _optim(save_dir, 1)
    os.truncate(path, path.stat().st_size - 1024)


def empty_optim_rank1(save_dir: Path, env: FaultEnv) -> None:
    os.truncate(_optim(save_dir, 1), 0)


def garble_optim_rank0(save_dir: Path, env: FaultEnv) -> None:
    path = _optim(save_dir, 0)
    path.write_bytes(bytes((i * 131 + 7) % 256 for i in range(path.stat().st_size)))


def legacy_serialization_rank1(save_dir: Path, env: FaultEnv) -> None:
    """Rank 1's optimizer file re-saved with torch's legacy (non-zip) serialization, as DeepSpeed's
    ``checkpoint.checkpoint_serialization: false`` writes it: the same content, no zip members."""
    import torch

    path = _optim(save_dir, 1)
    state = torch.load(path, map_location="cpu", weights_only=False)
    torch.save(state, path, _use_new_zipfile_serialization=False)


def foreign_optim_rank1(save_dir: Path, env: FaultEnv) -> None:
    """Rank 1's optimizer file replaced by the same-named file of another run (parameter_alignment on)."""
    source = _optim(env.donor, 1)
    shutil.copyfile(source, _optim(save_dir, 1))


def delete_stage3_model_rank1(save_dir: Path, env: FaultEnv) -> None:
    _model(save_dir, 1).unlink()


def delete_model_states(save_dir: Path, env: FaultEnv) -> None:
    _model(save_dir).unlink()


def bad_latest(save_dir: Path, env: FaultEnv) -> None:
    (save_dir / "latest").write_text("global_step9")


def swap_optim_ranks(save_dir: Path, env: FaultEnv) -> None:
    a, b = _optim(save_dir, 0), _optim(save_dir, 1)
    tmp = a.with_name("swap.tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def resave_without_moments(save_dir: Path, env: FaultEnv) -> None:
    _edit(_optim(save_dir, 1), lambda state: state["optimizer_state_dict"].pop("base_optimizer_state"))


def malicious_pickle(save_dir: Path, env: FaultEnv) -> None:
    _edit(_optim(save_dir, 1), lambda state: state.__setitem__("client_state", _Evil(env.marker)))


def stage_disagreement(save_dir: Path, env: FaultEnv) -> None:
    from deepspeed.runtime.zero.config import ZeroStageEnum

    _edit(
        _optim(save_dir, 1),
        lambda state: state["optimizer_state_dict"].__setitem__("zero_stage", ZeroStageEnum.optimizer_states),
    )


def version_skew(save_dir: Path, env: FaultEnv) -> None:
    def change(state):
        state["ds_version"] = state["optimizer_state_dict"]["ds_version"] = "0.14.0"

    _edit(_optim(save_dir, 1), change)


def shorten_partition(save_dir: Path, env: FaultEnv) -> None:
    def change(state):
        flat = state["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        flat[0] = flat[0][:-2].clone()

    _edit(_optim(save_dir, 1), change)


def wrong_alias_owner(save_dir: Path, env: FaultEnv) -> None:
    _edit(_model(save_dir), lambda state: state["shared_params"].__setitem__("head.weight", "l2.weight"))


def drop_frozen_fragment(save_dir: Path, env: FaultEnv) -> None:
    _edit(_model(save_dir, 1), lambda state: state["frozen_param_fragments"].pop("frozen.weight"))


def _flip_element(path: Path, holder: str, name: str, element: int) -> None:
    """Flip a bit of one element of a tensor of a torch file, in place (metadata unchanged)."""
    from ckptspec.checkpoint import torchfile

    ref = torchfile.read_pt_metadata(path)[holder][name]
    offset, _ = torchfile.tensor_byte_range(ref, torchfile.zip_member_locations(path))
    with open(path, "r+b") as fh:
        fh.seek(offset + element * ref.storage.itemsize)
        byte = fh.read(1)
        fh.seek(offset + element * ref.storage.itemsize)
        fh.write(bytes([byte[0] ^ 0x40]))


def flip_frozen_element(save_dir: Path, env: FaultEnv) -> None:
    _flip_element(_model(save_dir), "module", "frozen.weight", 100)


def resave_model_states(save_dir: Path, env: FaultEnv) -> None:
    """The model states re-saved with a larger pickle: every tensor member moves."""
    _edit(_model(save_dir), lambda state: state.__setitem__("note", "re-saved " * 200))


def optimizer_step_of_another_save(save_dir: Path, env: FaultEnv) -> None:
    import torch

    def change(state):
        state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["step"] = torch.tensor(3.0)

    _edit(_optim(save_dir, 1), change)


def model_counters_of_another_save(save_dir: Path, env: FaultEnv) -> None:
    _edit(_model(save_dir, 1), lambda state: state.update(global_steps=3, global_samples=24))


def save_id_of_another_save(save_dir: Path, env: FaultEnv) -> None:
    import json

    from ckptspec.checkpoint.pt_rewrite import rewrite_pt_with_item

    path = _model(save_dir, 1)
    state = _load(path)
    doc = json.loads(state["ckptspec_manifest"])
    doc["save"]["id"] = "00000000-0000-4000-8000-000000000000"
    rewrite_pt_with_item(path, "ckptspec_manifest", json.dumps(doc))


def embed_after_the_manifest(save_dir: Path, env: FaultEnv) -> None:
    """docs/guide.md's steps before #37: a `generate --hash` manifest kept, then `ckptspec embed`,
    which rewrites the model states (the manifest goes into its client state; every record moves)."""
    from ckptspec.deepspeed.embed import embed_checkpoint

    embed_checkpoint(save_dir)


def _load(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def shift_slice_mapping(save_dir: Path, env: FaultEnv) -> None:
    def change(state):
        mapping = state["optimizer_state_dict"]["param_slice_mappings"][0]
        first = next(iter(mapping))
        mapping[first] = type(mapping[first])(numel=mapping[first].numel - 1, start=mapping[first].start + 1)

    _edit(_optim(save_dir, 1), change)


# --------------------------------------------------------------------------- the suite

S2, S3, S1, RR, G2 = "s2-bf16-ws2", "s3-bf16-ws2-sub", "s1-bf16-ws2", "s2-fp32-ws3-rr", "s2-fp16-ws2-groups"
OPT1_BF16 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
HOOK_S3 = "embed-s3-fp16-ws2-groups-sub"  # saved through ckptspec's save hook: a save id in every copy


def leftover_temporary(save_dir: Path, env: FaultEnv) -> None:
    """What a ckptspec write killed by SIGKILL leaves: a temporary named by its (dead) writer."""
    import subprocess
    import sys

    from ckptspec._fs import _HOST

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    name = f".mp_rank_00_model_states.pt.ckptspec-{_HOST}-{int(dead.stdout)}-k1ll3d.tmp"
    (tag_dir(save_dir) / name).write_bytes(b"half of a file")


def reconstructed_into_tag_dir(save_dir: Path, env: FaultEnv) -> None:
    """What `ckptspec reconstruct CK CK/<tag>` wrote before it was refused: the weights beside the shards."""
    from ckptspec.export.api import reconstruct

    out = env.marker.with_name("reconstructed")
    reconstruct(save_dir, out)
    for path in out.iterdir():
        shutil.move(path, tag_dir(save_dir) / path.name)
    out.rmdir()


FAULTS = [
    Fault(
        "transposed-shape",
        S2,
        "stage 2: `param_shapes` records `l2.weight` as (33, 16) instead of (16, 33)",
        "CK216",
        "mp_rank_00_model_states.pt",
        transpose_shape,
    ),
    Fault(
        "emptied-shared-params-s3",
        S3,
        "stage 3: rank 0's `shared_params` emptied (the tie head.weight → emb.weight is lost)",
        "CK215",
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        empty_shared_params,
    ),
    Fault(
        "emptied-shared-params-s1",
        S1,
        "stage 1: `shared_params` emptied",
        "CK219",
        "mp_rank_00_model_states.pt",
        empty_shared_params,
    ),
    Fault(
        "reordered-param-shapes",
        S2,
        "stage 2: `l1.weight` and `l2.weight` swapped in `param_shapes`",
        "CK217",
        "mp_rank_00_model_states.pt",
        reorder_param_shapes,
    ),
    Fault(
        "round-robin-natural-order",
        RR,
        "stage 2, round robin (3 ranks): `param_shapes` written in natural order (DeepSpeed #1165)",
        "CK217",
        "mp_rank_00_model_states.pt",
        natural_order_param_shapes,
    ),
    Fault(
        "wrong-alias-owner",
        S2,
        "stage 2: `shared_params` ties head.weight to l2.weight instead of emb.weight",
        "CK219",
        "mp_rank_00_model_states.pt",
        wrong_alias_owner,
    ),
    Fault("missing-rank", S2, "stage 2: rank 1's optimizer file deleted", "CK206", OPT1_BF16, delete_optim_rank1),
    Fault(
        "stale-extra-rank",
        S2,
        "stage 2, 2 ranks: a rank-2 optimizer file left over from a 4-rank run",
        "CK207",
        "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
        add_stale_rank2,
        donor="s2-bf16-ws4",
    ),
    Fault(
        "truncated-shard",
        S2,
        "stage 2: rank 1's optimizer file cut to half its size",
        "CK205",
        OPT1_BF16,
        truncate_optim_rank1,
    ),
    Fault(
        "truncated-shard-vs-manifest",
        S2,
        "stage 2: 1 KiB cut from the end of rank 1's optimizer file (checked against a `--hash` manifest)",
        "CK208",
        OPT1_BF16,
        cut_optim_rank1_tail,
        hashed_manifest=True,
    ),
    Fault(
        "empty-shard", S3, "stage 3: rank 1's optimizer file emptied (0 bytes)", "CK205", OPT1_BF16, empty_optim_rank1
    ),
    Fault(
        "not-a-zip",
        G2,
        "stage 2: rank 0's optimizer file overwritten with garbage bytes",
        "CK205",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        garble_optim_rank0,
    ),
    Fault(
        "legacy-serialization",
        "committed:s2-bf16-ws2",
        "stage 2: rank 1's optimizer file in torch's legacy (non-zip) serialization (checkpoint_serialization false)",
        "CK202",
        OPT1_BF16,
        legacy_serialization_rank1,
    ),
    Fault(
        "foreign-shard",
        S2,
        "stage 2: rank 1's optimizer file replaced by the same-named file of another run (parameter_alignment on)",
        "CK213",
        OPT1_BF16,
        foreign_optim_rank1,
        donor="s2-bf16-ws2-align",
    ),
    Fault(
        "shortened-partition",
        S2,
        "stage 2: rank 1's fp32 partition saved 2 elements short",
        "CK213",
        OPT1_BF16,
        shorten_partition,
    ),
    Fault(
        "stage-disagreement",
        S2,
        "stage 2: rank 1's optimizer file says ZeRO stage 1",
        "CK211",
        OPT1_BF16,
        stage_disagreement,
    ),
    Fault(
        "version-skew",
        S2,
        "stage 2: rank 1's optimizer file written by another DeepSpeed version",
        "CK211",
        OPT1_BF16,
        version_skew,
    ),
    Fault(
        "shifted-slice-mapping",
        S2,
        "stage 2: rank 1's `param_slice_mappings` shifted by one element",
        "CK218",
        OPT1_BF16,
        shift_slice_mapping,
    ),
    Fault(
        "stage3-param-shapes-disagree",
        S3,
        "stage 3: rank 1's copy of `param_shapes` lists sub-group 1 in another order",
        "CK212",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        reorder_rank1_param_shapes,
    ),
    Fault(
        "missing-stage3-model-states",
        S3,
        "stage 3: rank 1's model states file deleted",
        "CK206",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        delete_stage3_model_rank1,
    ),
    Fault(
        "dropped-frozen-fragment",
        S3,
        "stage 3: `frozen.weight` removed from rank 1's `frozen_param_fragments`",
        "CK220",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        drop_frozen_fragment,
    ),
    Fault("missing-model-states", S2, "stage 2: the model states file deleted", "CK203", None, delete_model_states),
    Fault("bad-latest", S2, "`latest` names a tag that does not exist", "CK201", None, bad_latest),
    Fault(
        "swapped-rank-files",
        S3,
        "stage 3: rank 0's and rank 1's optimizer files swapped (checked against a `--hash` manifest)",
        "CK209",
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        swap_optim_ranks,
        hashed_manifest=True,
    ),
    Fault(
        "swapped-rank-files-no-manifest",
        S3,
        "stage 3: rank 0's and rank 1's optimizer files swapped (no manifest: the directory alone)",
        "CK210",
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        swap_optim_ranks,
    ),
    Fault(
        "stale-manifest-locators",
        S2,
        "stage 2: rank 1's optimizer file re-saved without its Adam moments after the `--hash` manifest was written",
        "CK214",
        OPT1_BF16,
        resave_without_moments,
        hashed_manifest=True,
    ),
    Fault(
        "leftover-temporary",
        "committed:s2-bf16-ws2",
        "a ckptspec write into the tag directory was killed and left its temporary file",
        "CK224",
        None,
        leftover_temporary,
        severity="warning",
    ),
    Fault(
        "reconstructed-into-tag-dir",
        "committed:s2-bf16-ws2",
        "`reconstruct`'s model.safetensors written into the tag directory: no part of the checkpoint, which "
        "DeepSpeed does not read",
        "CK226",
        "model.safetensors",
        reconstructed_into_tag_dir,
        severity="warning",
    ),
    Fault(
        "reconstructed-into-tag-dir-hashed",
        "committed:s2-bf16-ws2",
        "`reconstruct`'s model.safetensors written into the tag directory after the `--hash` manifest was written "
        "(a file the manifest does not list, but a warning: DeepSpeed does not read it)",
        "CK226",
        "model.safetensors",
        reconstructed_into_tag_dir,
        hashed_manifest=True,
        severity="warning",
    ),
    Fault(
        "flipped-frozen-element",
        "committed:s2-bf16-ws2",
        "stage 2: one bit of `frozen.weight` flipped in the model states (checked against the tensor digests of a "
        "`--hash` manifest whose file hashes were removed)",
        "CK222",
        "mp_rank_00_model_states.pt",
        flip_frozen_element,
        hashed_manifest=True,
        digests_only=True,
    ),
    Fault(
        "moved-tensor-members",
        "committed:s2-bf16-ws2",
        "stage 2: the model states re-saved (every tensor member moved) after the `--hash` manifest was written",
        "CK221",
        "mp_rank_00_model_states.pt",
        resave_model_states,
        hashed_manifest=True,
    ),
    Fault(
        "manifest-before-embed",
        "committed:s2-bf16-ws2",
        "stage 2: `ckptspec embed` run after the `--hash` manifest was written (the model states now carry it)",
        "CK227",
        "mp_rank_00_model_states.pt",
        embed_after_the_manifest,
        hashed_manifest=True,
    ),
    Fault(
        "optimizer-file-of-another-save",
        "committed:s2-bf16-ws2",
        "stage 2: rank 1's optimizer file records step 3 where rank 0's records step 2 (a file of another save)",
        "CK223",
        OPT1_BF16,
        optimizer_step_of_another_save,
    ),
    Fault(
        "model-file-of-another-save",
        S3,
        "stage 3: rank 1's model states record global step 3 where rank 0's record step 2 (a file of another save)",
        "CK223",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        model_counters_of_another_save,
    ),
    Fault(
        "save-id-of-another-save",
        HOOK_S3,
        "stage 3, saved by ckptspec's hook: rank 1's model states carry another save id than the sidecar",
        "CK223",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        save_id_of_another_save,
    ),
    Fault(
        "malicious-pickle",
        G2,
        "stage 2: rank 1's optimizer file carries a pickle that runs code when loaded",
        "CK204",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        malicious_pickle,
    ),
]

from .faults_parallel import PARALLEL_FAULTS  # noqa: E402  (they build on the helpers above)

FAULTS += PARALLEL_FAULTS

BASES = sorted({f.base for f in FAULTS} | {f.donor for f in FAULTS if f.donor})


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root with its size and modification time: proof that nothing was written."""
    return {
        p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


from .faults_masters import MASTERS_FAULTS  # noqa: E402  (#17: MoE and stage 0)

FAULTS += MASTERS_FAULTS

from .faults_copies import COPIES_FAULTS, COPIES_INDEX_FAULTS  # noqa: E402  (#39: copies of another run)

FAULTS += COPIES_FAULTS + COPIES_INDEX_FAULTS


def flip_a_byte(data: bytes) -> bytes:
    """One bit of the first tensor's bytes, the file's size and structure kept: only a recorded hash tells."""
    import io
    import struct
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        member = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size >= 8)
    name_length, extra_length = struct.unpack("<HH", data[member.header_offset + 26 : member.header_offset + 30])
    start = member.header_offset + 30 + name_length + extra_length  # past the local header (torch pads its extra)
    assert data[start : start + member.file_size] == zipfile.ZipFile(io.BytesIO(data)).read(member)
    flipped = bytearray(data)
    flipped[start + 5] ^= 0x10
    return bytes(flipped)

"""``ckptspec.DeepSpeedReader``: a DeepSpeed checkpoint loaded in place by ``dcp.load`` (issue #41), in one process.

Every key the reader gives equals the same key of the checkpoint's DCP export (``export --format dcp``, whose
loads by FSDP2 jobs tests/export/test_dcp.py and test_dcp_kinds.py hold against the live DeepSpeed engines),
bit for bit and in dtype, read by torch's own ``FileSystemReader``; the reader reads the tensors' bytes and not
one more. A box of a tensor (what one rank's shard asks for) reads exactly the box's bytes, wherever the
tensor's ZeRO partitions cut it, and holds the whole tensor's elements of the box. The FSDP2 jobs that load
through the reader at world sizes 1, 2 and 3 are tests/export/test_dcp_reader_jobs.py.
"""

from __future__ import annotations

import warnings

import pytest
from _harness.parallel_oracles import bits_equal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptspec

# Plain ZeRO 1/2/3 in bf16 and fp32, each with two groups, a tie, a frozen parameter and buffers; a
# tensor x data parallel, a pipeline x data parallel, a pipeline with a tie, a frozen weight and a buffer,
# MoE and stage 0 (the kinds of tests/export/test_dcp_kinds.py).
SOURCES = [
    "dcp-s1-bf16-ws2-groups",
    "dcp-s2-fp32-ws2-groups",
    "dcp-s3-bf16-ws2-groups",
    "dcp-s3-fp32-ws2-groups",
    "tp2dp2-s2-bf16-ws4",
    "pp2dp2-s1-bf16-ws4",
    "pp2-s1-fp32-ws2-extras",
    "moe-ep2-s2-bf16-ws2",
    "s0-bf16-ws2",
]


def _load(state_keys, reader):
    """``dcp.load`` into a flat state dict of ``state_keys``' shapes and dtypes (non-tensors as placeholders)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    state = {
        key: torch.full(tuple(meta.size), 7, dtype=meta.properties.dtype)
        if isinstance(meta, TensorStorageMetadata)
        else "unset"
        for key, meta in state_keys.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


@pytest.mark.parametrize("source", SOURCES)
def test_the_reader_gives_what_the_export_holds(ds, source, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckptspec.export_dcp(ds.path(source), tmp_path / "dcp")
    exported = dcp.FileSystemReader(str(tmp_path / "dcp"))
    keys = exported.read_metadata().state_dict_metadata
    reader = ckptspec.DeepSpeedReader(ds.path(source))
    ours = reader.read_metadata().state_dict_metadata
    assert list(ours) == list(keys)  # the same keys, in the same order
    for key, meta in keys.items():
        assert type(ours[key]) is type(meta), key
        if isinstance(meta, TensorStorageMetadata):
            assert (ours[key].size, ours[key].properties.dtype) == (meta.size, meta.properties.dtype), key

    theirs, mine = _load(keys, exported), _load(keys, reader)
    ties = {f"model.{alias}" for alias in ckptspec.open(ds.path(source)).aliases}
    tensors = 0
    for key, value in theirs.items():
        if isinstance(keys[key], TensorStorageMetadata):
            assert bits_equal(mine[key], value), key
            if not key.endswith(".step") and key not in ties:  # steps: from the document; a tie: its owner's
                tensors += value.numel() * value.element_size()
        else:
            assert value != "unset" and mine[key] == value, key
    # Every tensor byte read once, and no other byte (no partition read whole for a part of it).
    assert reader.bytes_read == tensors > 0


def _cut_tensors(checkpoint):
    """The tensors stored in more than one segment (cut by a partition boundary), with their segments."""
    from ckptspec.export.dcp import plan_dcp

    plan = plan_dcp(checkpoint)
    return {key: s for key, s in plan.tensors.items() if len({seg.path for seg in s.segments}) > 1}


@pytest.fixture(scope="module")
def zero2(ds):
    """A ZeRO-2 bf16 checkpoint's reader, its cut tensors and their whole values (read as torch's export does)."""
    import torch

    from ckptspec.export.arrays import ShardReader, read_array
    from ckptspec.export.writers import to_torch

    checkpoint = ckptspec.open(ds.path("dcp-s2-bf16-ws2-groups"))
    cut = _cut_tensors(checkpoint)
    with ShardReader() as files:
        wholes = {key: to_torch(read_array(s, s.dtype, files), s.dtype) for key, s in cut.items()}
    reader = ckptspec.DeepSpeedReader(ds.path("dcp-s2-bf16-ws2-groups"))
    reader.read_metadata()
    assert cut and all(t.dtype == torch.float32 for t in wholes.values())
    return reader, cut, wholes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_box_reads_exactly_its_bytes_across_a_partition_boundary(zero2, data):
    from ckptspec.export.arrays import ShardReader

    reader, cut, wholes = zero2
    key = data.draw(st.sampled_from(sorted(cut)))
    source, whole = cut[key], wholes[key]
    offsets = [data.draw(st.integers(0, n - 1)) for n in whole.shape]
    lengths = [data.draw(st.integers(1, n - o)) for n, o in zip(whole.shape, offsets)]
    before = reader.bytes_read
    with ShardReader() as files:
        box = reader._read_box(source, offsets, lengths, files)
    expected = whole[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    assert bits_equal(box, expected), (key, offsets, lengths)
    assert reader.bytes_read - before == expected.numel() * 4


def test_a_row_box_across_the_boundary_is_one_range_per_file(zero2):
    """A shard of whole rows (FSDP2's ``Shard(0)``) is one read in each partition file it spans."""
    from ckptspec.export.dcp_source import box_segments

    _, cut, wholes = zero2
    key = next(k for k in sorted(cut) if wholes[k].dim() == 2)
    source = cut[key]
    rows = wholes[key].shape[0]
    segments = list(box_segments(source, [0, 0], [rows, wholes[key].shape[1]]))
    assert [s.path for s in segments] == [s.path for s in source.segments]
    assert sum(s.nbytes for s in segments) == wholes[key].numel() * 4


def test_key_map_renames_and_leaves_out_keys(ds, tmp_path):
    """The weights only, under another prefix: each renamed key holds its own key's tensor; nothing else is read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source = ds.path("dcp-s3-bf16-ws2-groups")
    ckptspec.export_dcp(source, tmp_path / "dcp")
    exported = dcp.FileSystemReader(str(tmp_path / "dcp"))
    keys = exported.read_metadata().state_dict_metadata
    theirs = _load(keys, exported)

    reader = ckptspec.DeepSpeedReader(source, key_map=lambda k: "net." + k[6:] if k.startswith("model.") else None)
    renamed = reader.read_metadata().state_dict_metadata
    assert sorted(renamed) == sorted("net." + k[6:] for k in keys if k.startswith("model."))
    mine = _load(renamed, reader)
    for key, value in mine.items():
        assert isinstance(renamed[key], TensorStorageMetadata)
        assert bits_equal(value, theirs["model." + key[4:]]), key
    ties = {f"net.{alias}" for alias in ckptspec.open(source).aliases}
    assert ties and reader.bytes_read == sum(v.numel() * v.element_size() for k, v in mine.items() if k not in ties)


def test_key_map_gives_one_value_to_several_keys(ds, tmp_path):
    """torchtitan's layout (examples/torchtitan_resume.py): the model's keys without a prefix, the optimizer's
    under ``optimizer``, each group's hyperparameters once per parameter of the group. Every key of a list
    holds its key's value; a tensor under two keys is read once."""
    import torch.distributed.checkpoint as dcp

    source = ds.path("dcp-s2-bf16-ws2-groups")
    ckptspec.export_dcp(source, tmp_path / "dcp")
    exported = dcp.FileSystemReader(str(tmp_path / "dcp"))
    keys = exported.read_metadata().state_dict_metadata
    theirs = _load(keys, exported)
    groups = [theirs["optim.param_groups.0.params"], theirs["optim.param_groups.1.params"]]

    def key_map(key: str):
        kind, _, rest = key.partition(".")
        if kind == "model":
            return [rest, f"copy.{rest}"] if rest == "l1.weight" else rest
        if rest.startswith("state."):
            return f"optimizer.{rest}"
        _, index, name = rest.split(".", 2)
        return None if name == "params" else [f"optimizer.param_groups.{fqn}.{name}" for fqn in groups[int(index)]]

    expected = {}
    for key in keys:
        names = key_map(key)
        for name in [names] if isinstance(names, str) else names or []:
            expected[name] = theirs[key]
    reader = ckptspec.DeepSpeedReader(source, key_map=key_map)
    mine = _load(reader.read_metadata().state_dict_metadata, reader)
    assert sorted(mine) == sorted(expected)
    per_param = [k for k in mine if k.startswith("optimizer.param_groups.")]
    assert len(per_param) == 11 * 5  # AdamW's 11 hyperparameters, for each of the 5 trainable parameters
    assert mine["optimizer.param_groups.l1.bias.weight_decay"] == 0.0
    assert mine["optimizer.param_groups.l1.weight.weight_decay"] == 0.01
    for name, value in expected.items():
        assert bits_equal(mine[name], value) if hasattr(value, "dtype") else mine[name] == value, name
    plain = ckptspec.DeepSpeedReader(source)
    _load(keys, plain)
    assert reader.bytes_read == plain.bytes_read > 0  # copy.l1.weight took l1.weight's box: no byte twice


def test_a_corrupt_checkpoint_is_refused_before_any_tensor_is_read(ds, tmp_path):
    """In one process (no torch.distributed), the reader validates for itself: the finding, nothing read."""
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp
    from _harness import faults

    copy = tmp_path / "checkpoint"
    shutil.copytree(ds.path("dcp-s2-bf16-ws2-groups"), copy)
    faults.truncate_optim_rank1(copy, None)
    finding = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt: $.files[2] (rank 1): CK205 zip directory unreadable"
    reader = ckptspec.DeepSpeedReader(copy)
    with pytest.raises(ckptspec.CheckpointInvalid) as raised:
        reader.read_metadata()
    assert raised.value.code == "CK205" and finding in [f.to_line()[: len(finding)] for f in raised.value.findings]
    state = {"model.l1.weight": torch.zeros(33, 16)}
    with warnings.catch_warnings(), pytest.raises(BaseException, match="CK205 zip directory unreadable"):
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=ckptspec.DeepSpeedReader(copy), no_dist=True)  # DCP wraps it
    assert reader.bytes_read == 0 and torch.equal(state["model.l1.weight"], torch.zeros(33, 16))


def test_the_checkpoint_may_be_given_as_dcp_checkpoint_id(ds, tmp_path):
    import torch

    source = ds.path("dcp-s1-bf16-ws2-groups")
    assert ckptspec.DeepSpeedReader.validate_checkpoint_id(source)
    assert ckptspec.DeepSpeedReader.validate_checkpoint_id(next(source.glob("global_step*")))  # a tag directory
    ckptspec.export_dcp(source, tmp_path / "dcp")
    assert not ckptspec.DeepSpeedReader.validate_checkpoint_id(tmp_path / "dcp")  # torch's own format
    assert not ckptspec.DeepSpeedReader.validate_checkpoint_id(tmp_path / "missing")

    import torch.distributed.checkpoint as dcp

    state = {"model.l1.weight": torch.zeros(33, 16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(source), storage_reader=ckptspec.DeepSpeedReader(), no_dist=True)
    assert torch.equal(state["model.l1.weight"], ckptspec.load_state_dict(source)["l1.weight"])


@pytest.mark.parametrize(
    "error",
    [
        "ReconstructMismatch",  # CK401: replicated copies differ (check_copies)
        "ReconstructUnsupported",  # CK402: no Adam state located
        "CheckpointInvalid",  # the findings of validation
        "RuntimeError",  # not ckptspec's: every rank must still fail
    ],
)
def test_every_rank_raises_the_error_of_the_rank_that_validated(error):
    """The verdict another rank receives (plain data) raises the validating rank's error: class, code, findings."""
    from ckptspec import errors
    from ckptspec.deepspeed.load.verdict import failed
    from ckptspec.export.dcp_source import planned
    from ckptspec.findings import finding

    found = [finding("CK205", "$.files[2]", "zip directory unreadable", "restore it", file="f.pt", rank=1)]
    raised = {
        "ReconstructMismatch": errors.ReconstructMismatch("replicated parameter 'w' differs", "/ckpt"),
        "ReconstructUnsupported": errors.ReconstructUnsupported("no optimizer state", "regenerate"),
        "CheckpointInvalid": errors.CheckpointInvalid(found, "/ckpt"),
        "RuntimeError": RuntimeError("a bug"),
    }[error]
    with pytest.raises(BaseException) as again:
        planned("/ckpt", failed(raised))
    if error == "RuntimeError":
        assert type(again.value) is RuntimeError and "RuntimeError: a bug" in str(again.value)
        return
    assert type(again.value) is type(raised) and str(again.value) == str(raised)
    assert (again.value.code, again.value.hint, again.value.file) == (raised.code, raised.hint, raised.file)
    assert getattr(again.value, "findings", None) == getattr(raised, "findings", None)


def test_a_whole_tensor_read_is_checked_against_its_recorded_digest(ds, tmp_path):
    """A format 1.1 manifest records each tensor's digest: one bit of a master flipped after it was written (the
    files' hashes left out, so that validation cannot tell) fails the read of that whole tensor with CK222."""
    import json
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp
    from click.testing import CliRunner

    from ckptspec.cli import cli

    copy = tmp_path / "checkpoint"
    shutil.copytree(ds.path("dcp-s2-bf16-ws2-groups"), copy)
    manifest = tmp_path / "manifest.json"
    assert CliRunner().invoke(cli, ["generate", str(copy), "--hash", "-o", str(manifest)]).exit_code == 0
    doc = json.loads(manifest.read_text())
    for f in doc["files"]:
        del f["hash"]
    manifest.write_text(json.dumps(doc))
    source = ckptspec.open(copy, manifest=manifest).plan.sources["l2.weight"]
    assert source.digest is not None
    victim = source.segments[0]
    with open(victim.path, "r+b") as f:  # the lowest bit of element 100's mantissa: bf16 rounding hides it
        f.seek(victim.offset + 4 * 100)
        byte = f.read(1)[0]
        f.seek(victim.offset + 4 * 100)
        f.write(bytes([byte ^ 1]))

    def load(keys):
        state = {key: torch.zeros(16, 33) for key in keys}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=ckptspec.DeepSpeedReader(copy, manifest=manifest), no_dist=True)
        return state

    load(["optim.state.l2.weight.exp_avg"])  # another tensor of the same partitions: read, its digest holds
    with pytest.raises(BaseException, match="CK222 l2.weight: sha256 of the tensor's elements"):
        load(["model.l2.weight"])

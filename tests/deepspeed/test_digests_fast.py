"""``digests_of`` (small tensors hashed from blocks read once, every other tensor by a forked
child) gives what ``digest_of`` gives tensor by tensor, and ``record_digests`` sets what
pydantic's assignment of a validated ``Digest`` sets, on real DeepSpeed checkpoints: every matrix
point and the parallel ones (stage 3's multi-range digests, per-rank fragments, the domains of a
checkpoint index)."""

from __future__ import annotations

import pytest
from _harness.scenarios import MATRIX, PARALLEL

from ckptspec import _forked
from ckptspec.deepspeed.describe import describe, digests
from ckptspec.deepspeed.layout.tag_dir import resolve_tag_dir
from ckptspec.format.codec import dumps
from ckptspec.format.index_models import CheckpointIndex
from ckptspec.format.models import Digest
from ckptspec.location import location

# Stage 0 and MoE: the index locates their masters (`masters`), there are no per-tensor digests.
DESCRIBED = [n for n in MATRIX + PARALLEL if not n.startswith(("s0-", "moe-")) and "-s0-" not in n]


def _one_by_one(covered, tag_dir):
    fds = {}
    try:
        return [digests.digest_of(c, location(tag_dir), fds) for c in covered]
    finally:
        for fd in fds.values():
            digests.os.close(fd)


@pytest.fixture(params=["in-process", "forked", "child-fails", "tiny-blocks"])
def way(request, monkeypatch):
    if request.param != "in-process":
        monkeypatch.setattr(digests, "_FORK_ABOVE", 0)
        monkeypatch.setattr(_forked, "can_fork", lambda: True)  # opt-in, and pytest's own threads would forbid it
    if request.param == "child-fails":
        monkeypatch.setattr(digests.Forked, "result", lambda self: None)
    if request.param == "tiny-blocks":  # most tensors cross a block's end; two blocks kept at once
        monkeypatch.setattr(digests, "_BLOCK", 64)
        monkeypatch.setattr(digests, "_BLOCKS_KEPT", 2)
    return request.param


def _manifests(path):
    """The manifests ``generate`` describes: one, or one per domain of a checkpoint index."""
    document = describe(path)
    return [domain.manifest for domain in document.domains] if isinstance(document, CheckpointIndex) else [document]


@pytest.mark.parametrize("name", DESCRIBED)
def test_digests_of_is_digest_of_tensor_by_tensor(name, way, ds):
    tag_dir = resolve_tag_dir(ds.path(name), None)
    covered = [c for m in _manifests(ds.path(name)) for c in digests.covered_tensors(m)]
    assert covered  # every layout here has tensors to digest
    assert digests.digests_of(covered, tag_dir) == _one_by_one(covered, tag_dir)
    if name == "s3-bf16-ws2-sub":  # stage 3 at two ranks splits each master across both ranks' files
        assert any(len(c.ranges) > 1 for c in covered)


@pytest.mark.parametrize("name", ["s2-bf16-ws2", "s3-bf16-ws2-sub", "s3-fp32-ws2-exclude"])
def test_record_digests_sets_what_assignment_sets(name, ds):
    fast, reference = describe(ds.path(name)), describe(ds.path(name))
    digests.add_digests(fast, resolve_tag_dir(ds.path(name), None))
    covered = list(digests.covered_tensors(reference))
    found = zip([c.where for c in covered], _one_by_one(covered, resolve_tag_dir(ds.path(name), None)))
    for where, sha256 in found:  # the assignment pydantic runs, of a validated Digest
        value = Digest(sha256=sha256)
        if where[0] != "groups":
            getattr(reference, where[0])[where[1]].digest = value
            continue
        param = reference.groups[where[1]].params[where[3]]
        if where[4] == "state_digests":
            param.state_digests = {**(param.state_digests or {}), where[5]: value}
        else:
            setattr(param, where[4], value)
    assert dumps(fast) == dumps(reference, reference=True)
    assert b'"state_digests"' in dumps(fast) and (b'"model_digest"' in dumps(fast)) == name.startswith("s2-")
    for fast_group, group in zip(fast.groups, reference.groups):
        assert [p.model_fields_set for p in fast_group.params] == [p.model_fields_set for p in group.params]
    assert [t.model_fields_set for t in fast.frozen + fast.buffers] == [
        t.model_fields_set for t in reference.frozen + reference.buffers
    ]


def test_a_file_cut_short_is_an_error_not_a_shorter_digest(way, ds, tmp_path):
    """A tensor past the end of its file (cut after the manifest was made) raises what digest_of
    raises, in-process or from the child, instead of hashing the bytes that are there."""
    source = resolve_tag_dir(ds.path("s2-bf16-ws2"), None)
    covered = list(digests.covered_tensors(describe(ds.path("s2-bf16-ws2"))))
    for f in source.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cut = tmp_path / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    ends = [o + n for c in covered for p, o, n in c.ranges if p == cut.name]
    cut.write_bytes(cut.read_bytes()[: max(ends) - 1])  # the last byte of the last tensor in it
    with pytest.raises(OSError, match="ends before byte"):
        _one_by_one(covered, tmp_path)
    with pytest.raises(OSError, match="ends before byte"):
        digests.digests_of(covered, tmp_path)

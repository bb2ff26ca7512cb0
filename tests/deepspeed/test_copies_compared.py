"""CK237: `validate` compares the copies the index records as replicated before any reconstruction. The real
checkpoints the copy faults start from (tests/_harness/faults_parallel.py, run in test_shards.py) validate
clean with every copy read, so the finding each fault gets is its changed copy's alone."""

import json

import pytest
from _harness.faults import FAULTS
from click.testing import CliRunner

from ckptspec.cli import cli
from ckptspec.deepspeed.check.cross_domain import copies

BASES = sorted({f.base for f in FAULTS if f.code == "CK237"})
# Every file holding a copy: each tensor and pipeline rank's optimizer file (masters and moments of the replicated
# biases, the head and the tie), layer 0's and 4's (the tie's frozen gain and buffer) and layer 3's (a buffer)
# per tensor rank; at stage 0, each tensor rank's model states (its buffers).
READ = {
    "tp2pp2-s1-fp32-ws4-extras": {f"zero_pp_rank_0_mp_rank_{mp:02d}_optim_states.pt" for mp in range(4)}
    | {f"layer_{layer:02d}-model_{tp:02d}-model_states.pt" for layer in (0, 3, 4) for tp in (0, 1)},
    "tp2-s0-bf16-ws2-buffers": {f"mp_rank_{tp:02d}_model_states.pt" for tp in (0, 1)},
}


def test_every_base_is_listed():
    assert set(BASES) == set(READ)


@pytest.mark.parametrize("name", BASES)
def test_untouched_copies_are_read_and_equal(name, ds, monkeypatch):
    """DeepSpeed's own save validates without a finding, and the check read the copies in every file that holds
    one (not a check that compared nothing)."""
    read: set[str] = set()
    digest = copies._digest

    def spied(where, ranges):
        read.update(path for path, _, _ in ranges)
        return digest(where, ranges)

    monkeypatch.setattr(copies, "_digest", spied)
    result = CliRunner().invoke(cli, ["validate", str(ds.path(name)), "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["findings"] == []
    assert read == READ[name]


@pytest.mark.parametrize("fault", [f for f in FAULTS if f.code == "CK237"], ids=lambda f: f.name)
def test_no_hash_reads_metadata_only(fault, ds, tmp_path, monkeypatch):
    """`--no-hash` keeps its promise (metadata and a few elements of each tensor): no copy is read, so a copy that
    differs is not seen there (docs/errors.md#ck237); `reconstruct`'s validation reads them (test_shards.py)."""
    import shutil

    save_dir = tmp_path / "ckpt"
    shutil.copytree(ds.path(fault.base), save_dir)
    fault.mutate(save_dir, None)
    monkeypatch.setattr(copies, "_digest", lambda *_: pytest.fail("a copy was read with --no-hash"))
    result = CliRunner().invoke(cli, ["validate", str(save_dir), "--no-hash"])
    assert result.exit_code == 0 and "CK237" not in result.output, result.output

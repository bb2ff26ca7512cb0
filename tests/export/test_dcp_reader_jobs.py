"""FSDP2 jobs load a DeepSpeed checkpoint in place: ``dcp.load(state, storage_reader=ckptspec.DeepSpeedReader(CKPT))``,
no export (issue #41).

A ZeRO-2 bf16 and a ZeRO-3 fp32 run (two groups, a tie, a frozen parameter, buffers) and the kinds of
DCP_PARALLEL_SOURCES (tp2 x dp2, pp2 x dp2, MoE ep2, stage 0) are loaded by FSDP2 jobs (``fully_shard`` on a CPU
mesh, gloo) of world size 1, 2 and 3 (tests/_harness/fsdp2_job.py, ``"reader": true``). The oracles are the
export's (tests/_harness/dcp_oracles.py): the live engines' masters and DeepSpeed's Adam state bit for bit, the
extra step as plain AdamW/Adam's. Each rank reads the bytes of its shards of the tensors, exactly (the issue's
goal: within 5%).

A corrupt checkpoint (a truncated optimizer file, two ranks' optimizer files swapped) loaded by a job of two
ranks fails on every rank with the finding, and no rank's model changes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _harness import faults, scenarios
from _harness.dcp_oracles import check_parallel_load, check_plain_load

OVERREAD = 1.05  # a rank reads at most its share of the tensors' bytes, plus this


@pytest.mark.parametrize("world_size", scenarios.FSDP2_WORLD_SIZES)
@pytest.mark.parametrize("source", scenarios.DCP_READER_SOURCES)
def test_fsdp2_loads_the_checkpoint_in_place(ds, source, world_size):
    import torch

    entry = ds.path(scenarios.fsdp2_reader_name(source, world_size))
    got = torch.load(entry / "fsdp2.pt", weights_only=False)
    assert not (entry / "dcp").exists()  # nothing was written
    if source in scenarios.DCP_PARALLEL_SOURCES:
        check_parallel_load(ds, source, world_size, got)
    else:
        check_plain_load(ds, source, world_size, got)
    read = got["bytes_read"]
    assert len(read) == world_size
    assert [validated for _, _, validated in read] == [True] + [False] * (world_size - 1)  # once, on rank 0
    for rank, (done, share, _) in enumerate(read):
        assert 0 < done <= share * OVERREAD, f"rank {rank} read {done} bytes, its share is {share}"
        assert done == share, f"rank {rank} read {done} bytes, its share is {share}"  # measured: exactly


def _job_task(spec: dict, load, out, parallel: bool) -> dict:
    args = {"spec": spec, "source": "corrupt", "load": str(load), "reader": True, "expect_error": True}
    return {"kind": "fsdp2", "args": {**args, **({"parallel": True} if parallel else {})}, "out": str(out)}


FAULTS = {  # fault -> (source, how, the finding every rank must raise)
    # a truncated file: its zip directory is gone
    "truncated": (
        "dcp-s2-bf16-ws2-groups",
        faults.truncate_optim_rank1,
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt: $.files[2] (rank 1): CK205 zip directory unreadable",
    ),
    # rank 0's and rank 1's optimizer files swapped: each holds the other rank's partition
    "swapped": (
        "dcp-s2-bf16-ws2-groups",
        faults.swap_optim_ranks,
        "$.files[1].path (rank 0): CK210 the file was saved as bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ),
}


@pytest.fixture(scope="module")
def corrupt_loads(ds, fsdp2_launch):
    """Fault -> the folder of the FSDP2 job's records (``failure.rank<r>.json``): both faults' copies loaded in one
    launch of two ranks, cached (``ds.cached``) on the sources, fsdp2_job.py, the faults, this file and the ckptspec
    modules the ranks imported."""
    from _harness import fsdp2_job
    from _harness.job.model import normalize_spec

    sources = {source: ds.path(source) for source, _, _ in FAULTS.values()}
    code = {Path(m.__file__).name: Path(m.__file__).read_text() for m in (fsdp2_job, faults)}
    identity = {
        "sources": {n: p.name for n, p in sources.items()},
        "code": {**code, "test": Path(__file__).read_text()},
    }

    def build(directory: Path, env: dict) -> None:
        tasks = []
        for fault, (source, corrupt, _) in FAULTS.items():
            copy = directory / fault / "checkpoint"
            shutil.copytree(sources[source], copy)
            corrupt(copy, None)
            spec = normalize_spec(scenarios.DCP_SOURCE_SPECS[source][0])
            tasks.append(_job_task(spec, copy, directory / fault / "out", parallel=False))
        fsdp2_launch(tasks, 2, directory, env=env)  # one launch of two ranks, both loads in it
        for fault in FAULTS:
            shutil.rmtree(directory / fault / "checkpoint")  # a copy of a cached entry: not kept

    entry = ds.cached("dcp-reader-corrupt", identity, build)
    return {fault: entry / fault / "out" for fault in FAULTS}


def test_a_corrupt_checkpoint_fails_every_rank_before_any_tensor_is_read(corrupt_loads):
    for fault, (_, _, finding) in FAULTS.items():
        for rank in (0, 1):
            record = json.loads((corrupt_loads[fault] / f"failure.rank{rank}.json").read_text())
            assert record["error"] is not None, f"{fault}: rank {rank} loaded a corrupt checkpoint"
            # DCP's CheckpointException carries every rank's own failure: each names the finding.
            failures = record["error"].split("Traceback (most recent call last): (RANK ")[1:]
            assert sorted(int(f.split(")", 1)[0]) for f in failures) == [0, 1], record["error"]
            assert all(finding in f for f in failures), f"{fault}: rank {rank} raised {record['error']}"
            assert record["unchanged"], f"{fault}: rank {rank}'s model changed"
            assert record["read"] == 0, f"{fault}: rank {rank} read tensor bytes"

"""The DCP reader in the jobs issue #41 names beyond one node of world size 1-3 (scenarios.DCP_READER_JOBS):

- **two nodes**: FSDP2 jobs of world size 4 run as two torchrun agents on this machine (``--nnodes 2``,
  ``--node_rank 0|1``, one rendezvous port, two ranks each; launch.run_nodes), loading every source of the reader's
  jobs of one node in place (ZeRO-2 bf16, ZeRO-3 fp32, tp2 x dp2, pp2 x dp2, MoE ep2, stage 0);
- **HSDP**: a 2x2 mesh (``("replicate", "shard")``, ``fully_shard(..., mesh=mesh)``) over those two nodes, so each
  node holds one replica, sharded over its two ranks; once with the reader and ``dcp.load`` on the whole job, once
  on each node's shard group (``process_group=``: each replica validates and plans on its own);
- **HTTP**: a job of two ranks reading the checkpoint from the tests' nginx (started by the job's rank 0).

The oracles are those of every reader job (tests/_harness/dcp_oracles.py): the live engines' masters and
DeepSpeed's Adam state bit for bit after the load (``full_tensor()``), the extra step as plain AdamW/Adam's, bit for
bit at world size 4 (FSDP2 and HSDP alike). Each rank reads exactly the bytes of its shards; an HSDP replica reads
what the same rank of a world-size-2 job reads.
"""

from __future__ import annotations

import pytest
from _harness import scenarios
from _harness.dcp_oracles import check_parallel_load, check_plain_load

JOBS = scenarios.DCP_READER_JOBS
NODES = [name for name, (_, _, nodes, _) in JOBS.items() if nodes == 2]
HTTP = "fsdp2-reader-http-ws2-dcp-s2-bf16-ws2-groups"


def _loaded(ds, name: str) -> dict:
    """The job's record, checked against the oracles of its source; each rank read exactly its share."""
    import torch

    source, world_size, _, _ = JOBS[name]
    got = torch.load(ds.path(name) / "fsdp2.pt", weights_only=False)
    if source in scenarios.DCP_PARALLEL_SOURCES:
        check_parallel_load(ds, source, world_size, got)
    else:
        check_plain_load(ds, source, world_size, got)
    assert len(got["bytes_read"]) == world_size
    for rank, (done, share, _) in enumerate(got["bytes_read"]):
        assert 0 < done == share, f"{name}: rank {rank} read {done} bytes, its share is {share}"
    return got


def _per_rank(ds, source: str, world_size: int) -> list[int]:
    """What each rank of the one-node reader job of ``world_size`` read."""
    import torch

    got = torch.load(ds.path(scenarios.fsdp2_reader_name(source, world_size)) / "fsdp2.pt", weights_only=False)
    return [done for done, _, _ in got["bytes_read"]]


@pytest.mark.parametrize("name", NODES)
def test_a_job_of_two_nodes_loads_the_checkpoint_in_place(ds, name):
    got = _loaded(ds, name)
    source, _, _, options = JOBS[name]
    # Two torchrun agents (two parent processes), each starting two ranks: node = rank // 2.
    ranks = got["ranks"]
    assert [(r["group_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {(r["group_world_size"], r["local_world_size"]) for r in ranks} == {(2, 2)}
    assert ranks[0]["agent"] == ranks[1]["agent"] != ranks[2]["agent"] == ranks[3]["agent"]
    read = [done for done, _, _ in got["bytes_read"]]
    validated = [here for _, _, here in got["bytes_read"]]
    if "mesh" not in options:  # FSDP2 over the 4 ranks: rank 0 validates for all
        assert validated == [True, False, False, False]
        return
    # HSDP: the replica of each node reads its shards as the ranks of a world-size-2 job read theirs (the same
    # boxes: the replicas read the same bytes, each from the files; DCP's load does not share reads across ranks).
    assert read[:2] == read[2:] == _per_rank(ds, source, 2)
    # On each node's shard group (process_group=), its rank 0 validates: ranks 0 and 2; else rank 0 only.
    assert validated == ([True, False, True, False] if options.get("group") else [True, False, False, False])


def test_a_job_reads_the_checkpoint_from_nginx(ds):
    got = _loaded(ds, HTTP)
    source = JOBS[HTTP][0]
    http = got["http"]
    assert http["url"].startswith("http://127.0.0.1:")
    path = "/" + http["url"].split("/", 3)[3]
    # Every request was to the served checkpoint and answered (none refused or failed).
    assert all(uri == "/" or uri.startswith(path) for _, uri, _, _, _ in http["requests"]), http["requests"]
    assert all(status in (200, 206, 301) for _, _, status, _, _ in http["requests"]), http["requests"]
    # Each rank read what it reads from the local checkpoint.
    read = [done for done, _, _ in got["bytes_read"]]
    assert read == _per_rank(ds, source, 2)
    # After validation and planning, nginx sent the tensors as byte ranges of the files, never a whole file, and
    # no more than the ranks read (some bytes were already fetched by validation; measured 23452 of 23548).
    sizes = {f.name: f.stat().st_size for f in (ds.path(source) / "global_step2").iterdir()}
    tensors = [r for r in http["requests"][http["mark"] :] if r[0] == "GET"]
    assert tensors and all(status == 206 and rng.startswith("bytes=") for _, _, status, _, rng in tensors), tensors
    assert all(sent < sizes[uri.rsplit("/", 1)[1]] for _, uri, _, sent, _ in tensors), tensors
    assert 0.95 * sum(read) <= sum(sent for _, _, _, sent, _ in tensors) <= sum(read)

"""#40 item 3: ``ckptspec reshard`` and ``export-universal`` under torchrun, the ranks sharing the work (split.py).

Ground truth: the harness's reshard of the same source to the same layout, which a real DeepSpeed job of the
target layout loaded and checked (test_reshard.py, test_reshard_moe.py, test_reshard_tensor.py). The split run,
at 2 and 3 processes of a real torchrun (gloo), must write those files byte for byte, each rank a share of the
files, reading less than one process reads; a corrupt source or a failing rank stops every rank with nothing
written.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from _harness.scenarios import DEGREE_RESHARDS, RESHARD_CASES

SPLIT_FAILURE = Path(__file__).with_name("split_failure_job.py")
SUBPROCESS = Path(__file__).with_name("subprocess_job.py")

# (harness entry whose "resharded" output a DeepSpeed job loaded, the command and its options, processes)
CASES = {
    "plain ZeRO-2 bf16 2 -> 3 ranks, 2 processes": ("reshard-s2-bf16-2to3", ["reshard", "--world-size", "3"], 2),
    "plain ZeRO-2 bf16 2 -> 3 ranks, 3 processes": ("reshard-s2-bf16-2to3", ["reshard", "--world-size", "3"], 3),
    "MoE ep2 -> ep1, ws4 -> ws2, 3 processes": (
        "moe-ep2-s2-bf16-ws4>ep1-ws2",
        ["reshard", "--world-size", "2", "--expert-parallel", "1"],
        3,
    ),
    "MoE ep2 at stage 0 -> ZeRO-2, ws4 -> ws2, 2 processes": (
        "moe-ep2-s0-bf16-ws4>s2-ws2",
        ["reshard", "--world-size", "2", "--stage", "2"],
        2,
    ),
    "AutoTP tp2 x dp2 -> tp4, 2 processes": (
        "tp2dp2-s2-bf16-ws4>tp4",
        ["reshard", "--world-size", "4", "--tensor-parallel", "4"],
        2,
    ),
    # each tensor rank's files by the ZeRO-3 writer (its zero_pp_rank_ model states)
    "AutoTP ZeRO-3 tp2 -> tp4 at stage 3, 3 processes": (
        "tp2-s3-bf16-ws2>tp4",
        ["reshard", "--world-size", "4", "--tensor-parallel", "4"],
        3,
    ),
    # the universal folders, which jobs loaded with load_universal (OUT/resharded/universal)
    "export-universal of a MoE ep2 ZeRO-2, 3 processes": ("moe-ep2-s2-bf16-ws4>universal-ws2", ["export-universal"], 3),
    "export-universal of a MoE ep2 at stage 0, 2 processes": (
        "moe-ep2-s0-fp32-ws4>universal-s1-ws2",
        ["export-universal"],
        2,
    ),
    "export-universal of AutoTP tp2 x dp2, 2 processes": (
        "tp2dp2-s2-bf16-ws4>universal-tp1-ws3",
        ["export-universal"],
        2,
    ),
    "export-universal of AutoTP ZeRO-3, 2 processes": ("tp2-s3-bf16-ws2>universal-ws4", ["export-universal"], 2),
    # a TiedLayerSpec on both stages (one folder), a frozen weight and a buffer
    "export-universal of a tied pipeline, 3 processes": (
        "pp2-s1-fp32-ws2-extras>universal-ws4",
        ["export-universal"],
        3,
    ),
}


def _source(entry: str) -> str:
    return RESHARD_CASES[entry][0] if entry in RESHARD_CASES else DEGREE_RESHARDS[entry][0]


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _per_rank(stdout: str) -> list[tuple[int, int]]:
    """The (files written, checkpoint bytes read) lines rank 0 prints for every rank, by rank."""
    return [
        (int(f), int(b)) for f, b in re.findall(r"rank \d+ of \d+: wrote (\d+) files, read (\d+) checkpoint", stdout)
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_split_writes_the_files_a_deepspeed_job_resumed_byte_for_byte(case, ds, torchrun, tmp_path):
    entry, (command, *options), nproc = CASES[case]
    checked = ds.path(entry) / "resharded"  # loaded by a DeepSpeed job of the target layout
    checked = checked / "universal" if command == "export-universal" else checked
    out = tmp_path / "out"
    run = torchrun(nproc, "-m", "ckptspec", command, ds.path(_source(entry)), out, *options)
    assert run.returncode == 0, run.stdout + run.stderr
    assert _files(out) == _files(checked)
    ranks = _per_rank(run.stdout)
    assert len(ranks) == nproc
    written = sum(files for files, _ in ranks)
    assert written == len(re.findall(r"\.pt$", "\n".join(_files(checked)), re.M))  # every torch file once
    assert all(files >= 1 for files, _ in ranks)  # every rank did a share


def test_two_nodes_write_what_one_process_writes(ds, torchrun, tmp_path):
    """Two torchrun agents (``--nnodes 2``, one process each), as two machines sharing OUTPUT's file system would
    run them: the same files as the harness's reshard, which a DeepSpeed job resumed."""
    entry = "reshard-s2-bf16-2to3"
    out = tmp_path / "out"
    run = torchrun(1, "-m", "ckptspec", "reshard", ds.path(_source(entry)), out, "--world-size", "3", nnodes=2)
    assert run.returncode == 0, run.stdout + run.stderr
    assert _files(out) == _files(ds.path(entry) / "resharded")
    assert [files for files, _ in _per_rank(run.stdout)] == [2, 2]  # rank 0 on node 0, rank 1 on node 1


def test_a_ckptspec_that_a_worker_starts_runs_alone(ds, torchrun, tmp_path):
    """A training job's rank 0 runs ``ckptspec reshard`` as a subprocess, which inherits the worker's torchrun
    variables: it must not join the job's group (it would wait for ranks that never come) but run as one process,
    writing what the harness's reshard wrote."""
    entry = "reshard-s2-bf16-2to3"
    out = tmp_path / "out"
    run = torchrun(2, SUBPROCESS, "reshard", ds.path(_source(entry)), out, "--world-size", "3")
    assert "ckptspec exited 0" in run.stdout, run.stdout + run.stderr
    assert run.returncode == 0, run.stdout + run.stderr
    assert _files(out) == _files(ds.path(entry) / "resharded")
    assert re.findall(r"rank (\d+) of (\d+): wrote", run.stdout) == [("0", "1")]  # one process, not a split


def test_each_rank_reads_a_share_of_what_one_process_reads(ds, torchrun, tmp_path):
    source = ds.path("s2-bf16-ws2")
    one = torchrun(1, "-m", "ckptspec", "reshard", source, tmp_path / "one", "--world-size", "3")
    three = torchrun(3, "-m", "ckptspec", "reshard", source, tmp_path / "three", "--world-size", "3")
    assert one.returncode == three.returncode == 0, one.stderr + three.stderr
    [(_, alone)] = _per_rank(one.stdout)
    shares = [read for _, read in _per_rank(three.stdout)]
    assert len(shares) == 3
    # each rank: its files' source ranges, a third of the hashing before and after the write (unsplit, that alone
    # is most of what one process reads); rank 0 also the commit (the model-states file it rewrites with the
    # manifest) and two of the four files: no rank reads half of what one process reads
    assert max(shares) < 0.5 * alone, (shares, alone)
    assert sum(shares) <= alone, (shares, alone)  # nothing read twice by two ranks


def test_a_corrupt_source_stops_every_rank_and_nothing_is_written(ds, torchrun, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ds.path("s2-bf16-ws2"), source)
    optim = next((source / "global_step2").glob("*zero_pp_rank_1_*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[:-100])  # truncated
    out = tmp_path / "out"
    run = torchrun(2, "-m", "ckptspec", "reshard", source, out, "--world-size", "3")
    assert run.returncode != 0
    assert "nothing was written" in run.stderr and " CK2" in run.stderr, run.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_a_rank_that_fails_stops_the_others_and_rank_0_removes_the_output(torchrun, tmp_path):
    """A failure of rank 1 alone while rank 0 writes (its disk, say): rank 0 learns it at its next exchange,
    names rank 1 and its error (CK918), exits with rank 1's status and leaves nothing behind."""
    out = tmp_path / "out"
    run = torchrun(2, SPLIT_FAILURE, out)
    logs = run.stdout + run.stderr
    assert run.returncode != 0
    assert "rank 1: OSError" in logs and "[Errno 28]" in logs, logs
    assert re.search(r"rank 0: CK918 rank 1 failed: OSError: \[Errno 28\].* exit 2", logs), logs
    assert list(tmp_path.iterdir()) == []

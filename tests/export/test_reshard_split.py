"""#40 item 3: ``ckptspec reshard`` and ``export-universal`` under torchrun, the ranks sharing the work (split.py).

Ground truth: the harness's reshard of the same source to the same layout, which a real DeepSpeed job of the
target layout loaded and checked (test_reshard.py, test_reshard_moe.py, test_reshard_tensor.py). The split run,
at 2 and 3 processes of a real torchrun (gloo), must write those files byte for byte, each rank a share of the
files, reading less than one process reads; a corrupt source or a failing rank stops every rank with nothing
written.

Every torchrun run of this file is one cached entry (``ds.cached``, the ``split_runs`` fixture): its outputs, exit
statuses, logs and what each run's directory held afterwards, keyed on the runs (commands, the source entries they
read), the two job scripts and, as the jobs, the ckptspec modules the runs' processes imported; a warm run starts
none of them, an edit to the code they run starts them all again. The tests assert on what the runs left.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from _harness.scenarios import (
    DEGREE_RESHARDS,
    RESHARD_CASES,
    TP_PIPE_EXTRAS_RESHARDS,
    TP_PIPE_SPLITS,
    TP_PIPE_STAGE_RESHARDS,
)

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
    # a tensor-parallel pipeline's tensor ranks each moved to one stage; merged, then moved (rank 0 alone)
    "tp2 x pp2 -> tp2 x pp1, 2 processes": (
        "tp2pp2-s1-fp32-ws4>pp1",
        ["reshard", "--world-size", "2", "--pipeline-parallel", "1"],
        2,
    ),
    "tp2 x pp2 -> tp1 x pp1, 2 processes": (
        "tp2pp2-s1-fp32-ws4>tp1-pp1",
        ["reshard", "--world-size", "2", "--tensor-parallel", "1", "--pipeline-parallel", "1"],
        2,
    ),
    # a tensor-parallel pipeline split to more tensor ranks: each (stage, tensor rank) and layer piece a file
    "tp2 x pp1 -> tp4 x pp1, 2 processes": (
        "tp2pp1-s1-fp32-ws2>tp4",
        ["reshard", "--world-size", "4", "--tensor-parallel", "4"],
        2,
    ),
    # ... with a TiedLayerSpec, a frozen column-parallel weight and buffers: each layer piece a file of its own
    "tp2 x pp1 -> tp4 x pp1, a tie, a frozen weight and buffers, 2 processes": (
        "tp2pp1-s1-fp32-ws2-extras>tp4",
        ["reshard", "--world-size", "4", "--tensor-parallel", "4"],
        2,
    ),
    # a bf16 pipeline written for a stage-0 job (BF16_Optimizer's files), an fp32 stage-0 pipeline at another data
    # degree (the torch optimizer's state in each stage's model states), an AutoTP stage-0 source split at ZeRO-1
    "bf16 pipeline ZeRO-1 -> stage 0, 2 processes": (
        "pp2-s1-bf16-ws2>s0",
        ["reshard", "--world-size", "2", "--stage", "0"],
        2,
    ),
    "fp32 stage-0 pipeline pp2 x dp1 -> pp2 x dp2, 2 processes": (
        "pp2-s0-fp32-ws2>ws4",
        ["reshard", "--world-size", "4"],
        2,
    ),
    "AutoTP stage-0 tp2 -> tp4 at ZeRO-1, 3 processes": (
        "tp2-s0-bf16-ws2-buffers>tp4-s1",
        ["reshard", "--world-size", "4", "--tensor-parallel", "4", "--stage", "1"],
        3,
    ),
    "export-universal of a tied pipeline, 3 processes": (
        "pp2-s1-fp32-ws2-extras>universal-ws4",
        ["export-universal"],
        3,
    ),
}
# merged to a temporary directory, then moved: rank 0 writes both steps alone (reshard_parallel._merge_then_restage)
RANK_0_ALONE = {"tp2 x pp2 -> tp1 x pp1, 2 processes"}
CORRUPT_SOURCE = "s2-bf16-ws2"  # copied and its rank 1 optimizer states truncated


def _source(entry: str) -> str:
    return {**RESHARD_CASES, **DEGREE_RESHARDS, **TP_PIPE_STAGE_RESHARDS, **TP_PIPE_SPLITS, **TP_PIPE_EXTRAS_RESHARDS}[
        entry
    ][0]


def _runs() -> dict[str, dict]:
    """Every torchrun run of this file: run id -> processes, nodes, what it runs (``{source}``: the source entry's
    path, ``{out}``: the run's output, in a directory of its own) and the source entry it reads."""
    runs = {}
    for case, (entry, (command, *options), nproc) in CASES.items():
        args = ["-m", "ckptspec", command, "{source}", "{out}", *options]
        runs[f"case: {case}"] = {"nproc": nproc, "args": args, "source": _source(entry)}
    reshard = ["-m", "ckptspec", "reshard", "{source}", "{out}", "--world-size", "3"]
    plain = _source("reshard-s2-bf16-2to3")
    runs["two nodes"] = {"nproc": 1, "nnodes": 2, "args": reshard, "source": plain}
    runs["a worker's subprocess"] = {
        "nproc": 2,
        "args": [SUBPROCESS.name, "reshard", "{source}", "{out}", "--world-size", "3"],
        "source": plain,
    }
    runs["shares: one process"] = {"nproc": 1, "args": reshard, "source": "s2-bf16-ws2"}
    runs["shares: three processes"] = {"nproc": 3, "args": reshard, "source": "s2-bf16-ws2"}
    runs["corrupt source"] = {"nproc": 2, "args": reshard, "source": CORRUPT_SOURCE, "corrupt": True}
    runs["a rank fails"] = {"nproc": 2, "args": [SPLIT_FAILURE.name, "{out}"]}
    return runs


def _truncate(source: Path) -> None:
    optim = next((source / "global_step2").glob("*zero_pp_rank_1_*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[:-100])  # truncated


@pytest.fixture(scope="module")
def split_runs(ds, torchrun):
    """Run id -> the run's directory (``out``: what it wrote, if anything) and ``run.json`` (exit status, stdout,
    stderr, the names its directory held after the run), every run built once in one cached entry."""
    runs = _runs()
    sources = {run["source"] for run in runs.values() if "source" in run}
    entries = {name: ds.path(name) for name in sorted(sources)}  # their names carry their keys
    scripts = {path.name: str(path) for path in (SPLIT_FAILURE, SUBPROCESS)}
    # the job scripts, and this file (the runs, the corruption, how a run is recorded)
    code = {path.name: path.read_text() for path in (SPLIT_FAILURE, SUBPROCESS, Path(__file__))}
    identity = {"runs": runs, "sources": {name: path.name for name, path in entries.items()}, "code": code}

    def build(directory: Path, env: dict) -> None:
        for number, (run_id, run) in enumerate(runs.items()):
            work = directory / f"run-{number:02d}"
            work.mkdir(parents=True)
            source = entries.get(run.get("source"))
            if run.get("corrupt"):
                shutil.copytree(source, work / "source")
                _truncate(work / "source")
                source = work / "source"
            where = {"{source}": str(source), "{out}": str(work / "out"), **scripts}
            args = [where.get(arg, arg) for arg in run["args"]]
            done = torchrun(run["nproc"], *args, env=env, nnodes=run.get("nnodes", 1))
            listing = sorted(p.name for p in work.iterdir())
            shutil.rmtree(work / "source", ignore_errors=True)  # a copy of a cached entry: not kept
            outcome = {"run": run_id, "returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
            (work / "run.json").write_text(json.dumps({**outcome, "listing": listing}, indent=1))

    entry = ds.cached("reshard-split", identity, build)
    found = {}
    for work in sorted(entry.glob("run-*")):
        run = json.loads((work / "run.json").read_text())
        found[run["run"]] = (work, run)
    assert sorted(found) == sorted(runs)
    return found


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _per_rank(stdout: str) -> list[tuple[int, int]]:
    """The (files written, checkpoint bytes read) lines rank 0 prints for every rank, by rank."""
    return [
        (int(f), int(b)) for f, b in re.findall(r"rank \d+ of \d+: wrote (\d+) files, read (\d+) checkpoint", stdout)
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_split_writes_the_files_a_deepspeed_job_resumed_byte_for_byte(case, ds, split_runs):
    entry, (command, *_), nproc = CASES[case]
    checked = ds.path(entry) / "resharded"  # loaded by a DeepSpeed job of the target layout
    checked = checked / "universal" if command == "export-universal" else checked
    work, run = split_runs[f"case: {case}"]
    assert run["returncode"] == 0, run["stdout"] + run["stderr"]
    assert _files(work / "out") == _files(checked)
    ranks = _per_rank(run["stdout"])
    assert len(ranks) == nproc
    written = sum(files for files, _ in ranks)
    assert written == len(re.findall(r"\.pt$", "\n".join(_files(checked)), re.M))  # every torch file once
    if case in RANK_0_ALONE:
        assert [files for files, _ in ranks[1:]] == [0] * (nproc - 1)
    else:
        assert all(files >= 1 for files, _ in ranks)  # every rank did a share


def test_two_nodes_write_what_one_process_writes(ds, split_runs):
    """Two torchrun agents (``--nnodes 2``, one process each), as two machines sharing OUTPUT's file system would
    run them: the same files as the harness's reshard, which a DeepSpeed job resumed."""
    work, run = split_runs["two nodes"]
    assert run["returncode"] == 0, run["stdout"] + run["stderr"]
    assert _files(work / "out") == _files(ds.path("reshard-s2-bf16-2to3") / "resharded")
    assert [files for files, _ in _per_rank(run["stdout"])] == [2, 2]  # rank 0 on node 0, rank 1 on node 1


def test_a_ckptspec_that_a_worker_starts_runs_alone(ds, split_runs):
    """A training job's rank 0 runs ``ckptspec reshard`` as a subprocess, which inherits the worker's torchrun
    variables: it must not join the job's group (it would wait for ranks that never come) but run as one process,
    writing what the harness's reshard wrote."""
    work, run = split_runs["a worker's subprocess"]
    assert "ckptspec exited 0" in run["stdout"], run["stdout"] + run["stderr"]
    assert run["returncode"] == 0, run["stdout"] + run["stderr"]
    assert _files(work / "out") == _files(ds.path("reshard-s2-bf16-2to3") / "resharded")
    assert re.findall(r"rank (\d+) of (\d+): wrote", run["stdout"]) == [("0", "1")]  # one process, not a split


def test_each_rank_reads_a_share_of_what_one_process_reads(split_runs):
    (_, one), (_, three) = split_runs["shares: one process"], split_runs["shares: three processes"]
    assert one["returncode"] == three["returncode"] == 0, one["stderr"] + three["stderr"]
    [(_, alone)] = _per_rank(one["stdout"])
    shares = [read for _, read in _per_rank(three["stdout"])]
    assert len(shares) == 3
    # each rank: its files' source ranges, a third of the hashing before and after the write (unsplit, that alone
    # is most of what one process reads); rank 0 also the commit (the model-states file it rewrites with the
    # manifest) and two of the four files: no rank reads half of what one process reads
    assert max(shares) < 0.5 * alone, (shares, alone)
    assert sum(shares) <= alone, (shares, alone)  # nothing read twice by two ranks


def test_a_corrupt_source_stops_every_rank_and_nothing_is_written(split_runs):
    _, run = split_runs["corrupt source"]
    assert run["returncode"] != 0
    assert "nothing was written" in run["stderr"] and " CK2" in run["stderr"], run["stderr"]
    assert run["listing"] == ["source"]  # no output, nothing beside it


def test_a_rank_that_fails_stops_the_others_and_rank_0_removes_the_output(split_runs):
    """A failure of rank 1 alone while rank 0 writes (its disk, say): rank 0 learns it at its next exchange,
    names rank 1 and its error (CK918), exits with rank 1's status and leaves nothing behind."""
    _, run = split_runs["a rank fails"]
    logs = run["stdout"] + run["stderr"]
    assert run["returncode"] != 0
    assert "rank 1: OSError" in logs and "[Errno 28]" in logs, logs
    assert re.search(r"rank 0: CK918 rank 1 failed: OSError: \[Errno 28\].* exit 2", logs), logs
    assert run["listing"] == []

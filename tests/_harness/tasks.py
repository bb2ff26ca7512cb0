"""Real-DeepSpeed job results for the tests: built on first use, many per launch, cached.

    from _harness import tasks
    save_dir = tasks.path("s2-bf16-ws2")          # a registered task (tests/_harness/scenarios.py)

The first request of any registered entry builds every registered entry that is missing, in
as few launches as possible (one per world size, ZeRO-3 or not, and wave; a resume
runs in the wave after the checkpoint it loads), under one lock: the other xdist worker waits for it, then finds
its entries built. A task that is not registered is built alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import cache, guard, record_imports
from .job import parallel_models
from .job.model import normalize_spec
from .launch import (
    ACCELERATE_MAIN,
    BEFORE_LOAD,
    DCP_SAVE_MAIN,
    FSDP2_MAIN,
    JOB_MAIN,
    OPTIM_MAIN,
    OPTIM_UNIVERSAL_MAIN,
    RESHARD_MAIN,
    RESUME_MAIN,
    SERVERS,
    TRAINER_MAIN,
    Done,
    HarnessError,
    job_env,
    run_launches,
    task_launch,
)

RECORDER = Path(record_imports.__file__)  # wraps the launches of tasks that run ckptspec
RECORD_SITE = Path(__file__).resolve().parent / "record_site"  # the same in every process of an example

KINDS = (
    "train",
    "resume",
    "parallel",
    "fsdp2",
    "reshard",
    "optim",
    "optim_universal",
    "dcp_save",
    "trainer",
    "accelerate",
)
# The kinds ``launched`` runs with a script of their own (job/main.py's otherwise), keyed with it and what it imports
LAUNCHED_SCRIPTS = {"validated_resume": (RESUME_MAIN, BEFORE_LOAD)}
_FAILED: dict[str, str] = {}  # name -> error, in this process: not retried in a batch
_OWN_ERROR: set[str] = set()  # of _FAILED, those whose launch failed in their own task: not run again alone


@dataclass(frozen=True)
class Task:
    """One job result: ``kind`` (job/main.py KINDS) run with ``args`` at ``world_size``.

    ``load`` names the registered task whose entry a resume loads. ``deepspeed`` is the version
    of an older DeepSpeed (tests/_harness/compat.py) to run it with; such tasks are built only
    when asked for by name, never in the default batch. ``nodes`` above 1: the job runs as that many
    torchrun agents (``--nnodes``; launch.run_nodes), ``world_size / nodes`` ranks each, as on several machines.
    """

    kind: str
    args: dict = field(hash=False)
    world_size: int
    load: str | None = None
    deepspeed: str | None = None
    nodes: int = 1

    @property
    def python(self) -> str:
        if self.deepspeed is None:
            return sys.executable
        from .compat import OLD_DEEPSPEED_VERSION, old_python

        if self.deepspeed != OLD_DEEPSPEED_VERSION:
            raise HarnessError(f"no virtualenv for DeepSpeed {self.deepspeed}")
        return old_python()

    def versions(self) -> dict:
        if self.deepspeed is None:
            return cache.versions()
        from .compat import TORCH_VERSION

        return {"deepspeed": self.deepspeed, "torch": TORCH_VERSION}

    def normalized(self) -> dict:
        if self.kind == "train":
            return normalize_spec(self.args)
        if self.kind in ("trainer", "accelerate"):  # their scripts' own arguments, no job/model.py spec
            return dict(self.args)
        if self.kind == "parallel":
            return parallel_models.normalize(self.args)
        if self.kind in ("optim", "optim_universal") or self.args.get("parallel"):  # a parallel entry loaded
            return {**self.args, "spec": parallel_models.normalize(self.args["spec"])}
        return {**self.args, "spec": normalize_spec(self.args["spec"])}  # resume, fsdp2, reshard, dcp_save

    @property
    def launch_group(self) -> tuple[int, bool, str, str, int]:
        """Tasks of one group may share a launch. ZeRO-3 leaves global state behind (tensor and
        module patches) that changes how a later stage-1/2 engine of the same process trains, so
        stage-3 jobs get launches of their own. Pipeline, AutoTP and MoE engines set DeepSpeed's
        process-group globals in ``deepspeed.utils.groups`` (``groups.mpu = engine.mpu``: a later
        data-parallel engine would partition over the pipeline's data group; an AutoTP job leaves
        its tensor-parallel groups, and a later MoE engine fails in ``deepspeed.initialize``), so
        each of those layouts gets launches of its own; dense "parallel" jobs (stage 0, universal
        sources) set none and share the data-parallel launches. A job of several nodes is a launch of its own
        (its agents), shared with the tasks of the same group and number of nodes."""
        if self.kind == "fsdp2":  # no DeepSpeed engine: every FSDP2 load of a world size shares a launch
            return self.world_size, False, "", "fsdp2", self.nodes
        if self.kind == "dcp_save":  # dcp_save_job.py: FSDP2 saves, a launch per world size
            return self.world_size, False, "", "dcp_save", self.nodes
        if self.kind in ("trainer", "accelerate"):  # their own scripts: a launch per world size and ZeRO-3 or not
            return self.world_size, self.args["stage"] == 3, "", self.kind, self.nodes
        spec = self.normalized() if self.kind in ("train", "parallel") else self.normalized()["spec"]
        family = parallel_models.layout(spec) if self.kind == "parallel" else ""
        family = "" if family == "dense" else family
        if self.kind == "reshard":  # reshard_job.py: launches of its own
            family = "reshard"
        if self.kind in ("optim", "optim_universal"):  # launches of their own, one family of engines each
            # and one set of degrees: DeepSpeed keeps the tensor- and expert-parallel groups of the process's
            # first engine (a tp4 load after a tp2 one read the checkpoint as tp2; an ep1 stage-0 load after
            # an ep2 one looked for expp_rank_1), so another degree in the same launch failed the whole launch
            degrees = "-".join(f"{axis}{spec[axis]}" for axis in ("tp", "pp", "ep"))
            family = f"{self.kind}-{parallel_models.layout(spec)}-{degrees}"
        return self.world_size, spec["stage"] == 3, self.deepspeed or "", family, self.nodes

    @property
    def runs_ckptspec(self) -> bool:
        if self.kind in ("optim", "optim_universal"):  # DeepSpeed alone, unless rank 0 reshards the checkpoint first
            return bool(self.args.get("reshard"))
        if self.kind == "parallel":
            return self.normalized()["save_with"] == "ckptspec"
        if self.kind == "dcp_save":
            return False
        if self.kind in ("trainer", "accelerate"):  # ckptspec's integrations run in every rank
            return True
        spec = self.normalized() if self.kind == "train" else None
        return self.kind in ("resume", "fsdp2", "reshard") or bool(spec["hooks"]) or spec["save_with"] == "ckptspec"


def _registry() -> dict[str, Task]:
    from .scenarios import REGISTRY

    return REGISTRY


def task_key(name: str, task: Task) -> str | None:
    """The key of everything but ckptspec's modules (those are the entry's suffix, see cache.py);
    None while the entry a task loads is not built (its key includes that entry's name)."""
    load = entry(task.load) if task.load else None
    if task.load and not cache.is_done(load):
        return None
    identity = {
        "kind": task.kind,
        "args": task.normalized(),
        "world_size": task.world_size,
        "versions": task.versions(),
        "job": cache.tree_digest(*cache.JOB_SOURCES),
        # The modules it imports are the entry's suffix; the recorder is part of this key.
        "ckptspec": cache.key({"recorder": RECORDER.read_text()}) if task.runs_ckptspec else None,
        "load": load.name if load else None,
    }
    if task.nodes != 1:  # as several nodes (the keys of one node's tasks stay as they were)
        identity["nodes"] = task.nodes
    if task.kind == "fsdp2":  # its own entry script (the other kinds' keys stay as they were)
        scripts = {"fsdp2_job": FSDP2_MAIN.read_text()}
        if task.args.get("http"):  # rank 0 starts nginx with servers.py (the other loads' keys stay as they were)
            scripts["servers"] = SERVERS.read_text()
        identity["script"] = cache.key(scripts)
    if task.kind == "dcp_save":
        scripts = {"dcp_save_job": DCP_SAVE_MAIN.read_text(), "fsdp2_job": FSDP2_MAIN.read_text()}  # it imports it
        identity["script"] = cache.key(scripts)
    if task.kind == "trainer":
        identity["script"] = cache.key({"trainer_job": TRAINER_MAIN.read_text(), "fsdp2_job": FSDP2_MAIN.read_text()})
    if task.kind == "accelerate":  # it imports trainer_job.py (outcome) and fsdp2_job.py (serve)
        scripts = {"accelerate_job": ACCELERATE_MAIN, "trainer_job": TRAINER_MAIN, "fsdp2_job": FSDP2_MAIN}
        identity["script"] = cache.key({name: path.read_text() for name, path in scripts.items()})
    if task.kind == "resume" and task.args.get("reshard"):  # job/resume.py imports it then
        identity["script"] = cache.key({"before": BEFORE_LOAD.read_text()})
    if task.kind == "reshard":  # with the module both import (the values the load must replace)
        identity["script"] = cache.key({"reshard_job": RESHARD_MAIN.read_text(), "before": BEFORE_LOAD.read_text()})
    if task.kind == "optim":
        identity["script"] = cache.key({"optim_job": OPTIM_MAIN.read_text(), "before": BEFORE_LOAD.read_text()})
    if task.kind == "optim_universal":
        identity["script"] = cache.key({"optim_universal_job": OPTIM_UNIVERSAL_MAIN.read_text()})
    return cache.key(identity)


def entry(name: str, task: Task | None = None) -> Path:
    """``name``'s complete entry if there is one (``cache.is_done``); else (never built, or built
    from ckptspec modules edited since) the path its lock and staging directory are named after."""
    task = task or _registry()[name]
    key = task_key(name, task) or "unbuilt-load"
    found = cache.find_recorded(name, key) if task.runs_ckptspec else None
    return found or cache.entry(name, key)


def path(name: str, task: Task | None = None) -> Path:
    """The complete entry of ``name`` (a registered task, or ``task`` under that name), built if needed."""
    guard.reached(f"the DeepSpeed job result {name!r}")
    registered = task is None
    task = task or _registry()[name]
    target = entry(name, task)
    if cache.is_done(target):
        return target
    if registered:
        with cache.locked(cache.root() / "batch"):
            if not cache.is_done(target):
                # The default batch, or every registered task of the same older DeepSpeed.
                same = (
                    None
                    if task.deepspeed is None
                    else [n for n, t in _registry().items() if t.deepspeed == task.deepspeed]
                )
                build_missing(same)
        target = entry(name, task)
        if cache.is_done(target):
            return target
    if registered and name in _OWN_ERROR:  # its batch failed in this task: the error is its own already
        raise HarnessError(_FAILED[name])
    # Not registered, or its batch failed before any task ran: alone, so that the error is this task's own.
    _FAILED.pop(name, None)
    with cache.locked(target):
        if not cache.is_done(entry(name, task)):
            failed = _launch_all([[(name, task)]], task.python, 1).failed
            if failed:
                raise HarnessError(failed[name])
    return entry(name, task)


def build_missing(names: list[str] | None = None, jobs: int | None = None) -> dict[str, str]:
    """Build every registered (or named) entry that is missing; returns name -> error for failures."""
    registry = _registry()
    wanted = names or [n for n, t in registry.items() if t.deepspeed is None]
    todo = {n: registry[n] for n in wanted if n not in _FAILED and not cache.is_done(entry(n))}
    jobs = jobs or int(os.environ.get("CKPTSPEC_DS_JOBS", "2"))
    failed: dict[str, str] = {}
    t0 = time.monotonic()
    while todo:
        wave = {n: t for n, t in todo.items() if not t.load or t.load not in todo}
        if not wave:
            raise HarnessError(f"circular loads among {sorted(todo)}")
        for n in wave:
            del todo[n]
        launches: dict[tuple, list] = {}
        for n, t in wave.items():
            if t.load and t.load in failed:
                failed[n] = f"its checkpoint {t.load} failed"
                continue
            launches.setdefault(t.launch_group, []).append((n, t))
        # Largest world sizes first: they take longest, so the launches finish together.
        ordered = [launches[group] for group in sorted(launches, reverse=True)]
        for python in dict.fromkeys(batch[0][1].python for batch in ordered):
            done = _launch_all([b for b in ordered if b[0][1].python == python], python, jobs)
            failed.update(done.failed)
            # A launch that failed in one task left the tasks after it unrun: they go again, in the next wave
            todo.update({n: registry[n] for n in done.unrun})
    _FAILED.update(failed)
    if names is None:
        cache.prune({n: entry(n) for n in registry})
        print(f"[harness] built missing DeepSpeed entries in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    return failed


@dataclass
class _Launched:
    failed: dict[str, str] = field(default_factory=dict)  # name -> error
    unrun: list[str] = field(default_factory=list)  # tasks after the one a launch failed in: never started


def _started(log: str, staged: list[Path]) -> int | None:
    """The index of the last task of a launch any rank started (job/main.py's serve prints ``[harness] rank R:
    KIND -> OUT`` before each task, and every rank passes a barrier after it, so every task before that one
    completed on every rank); None when the launch failed before its first task."""
    outs = {f" -> {stage / 'out'}\n": i for i, stage in enumerate(staged)}
    lines = [line for line in log.splitlines(keepends=True) if line.startswith("[harness] rank ")]
    return max((i for line in lines for out, i in outs.items() if line.endswith(out)), default=None)


def _launch_all(batches: list[list[tuple[str, Task]]], python: str, jobs: int) -> _Launched:
    """One launch per batch (its tasks all of one launch group), ``jobs`` at a time, all forked from
    one job/ranks.py process; each entry published on success. A launch that failed in one of its tasks
    (``_started``) publishes the tasks before it, fails that task with the launch's error (its own: the caller
    does not run it again alone) and returns the tasks after it as unrun; one that failed before its first task
    fails them all."""
    planned, launches, done = [], [], _Launched()
    try:
        for batch in batches:
            assert len({t.launch_group for _, t in batch}) == 1
            staged = [cache.staging(entry(n, t)) for n, t in batch]
            planned.append((batch, staged))
            tasks = [
                {"kind": t.kind, "args": _job_args(t), "out": str(stage / "out")}
                for (_, t), stage in zip(batch, staged)
            ]
            script = {
                "fsdp2": FSDP2_MAIN,
                "reshard": RESHARD_MAIN,
                "optim": OPTIM_MAIN,
                "optim_universal": OPTIM_UNIVERSAL_MAIN,
                "dcp_save": DCP_SAVE_MAIN,
                "trainer": TRAINER_MAIN,
                "accelerate": ACCELERATE_MAIN,
            }.get(batch[0][1].kind, JOB_MAIN)
            launch = task_launch(tasks, batch[0][1].world_size, staged[0], script, batch[0][1].nodes)
            if any(t.runs_ckptspec for _, t in batch):  # record the ckptspec modules its ranks import
                (staged[0] / "imports").mkdir()
                launch = replace(launch, script=RECORDER, args=[str(staged[0] / "imports"), str(script), *launch.args])
            launches.append(launch)
        for (batch, staged), launch, outcome in zip(planned, launches, run_launches(launches, python, max(1, jobs))):
            if isinstance(outcome, HarnessError):
                at = _started(launch.log.read_text(errors="replace") if launch.log.is_file() else "", staged)
                if at is None:
                    done.failed.update({n: str(outcome) for n, _ in batch})
                    continue
                name = batch[at][0]
                done.failed[name] = f"task {name} failed (the tasks before it in its launch completed):\n{outcome}"
                _OWN_ERROR.add(name)
                done.unrun += [n for n, _ in batch[at + 1 :]]
                batch, staged = batch[:at], staged[:at]
                if not batch:
                    continue
                outcome = Done(str(outcome), 0.0)  # the tasks before it completed: published, with the launch's log
            # One line per launch in the prebuild log: where a cold run's minutes go
            names = ", ".join(n for n, _ in batch)
            print(f"[harness] {outcome.seconds:6.1f}s ws={batch[0][1].world_size} {names}", file=sys.stderr)
            modules = sorted(record_imports.read(staged[0] / "imports")) if (staged[0] / "imports").is_dir() else []
            for (name, task), stage in zip(batch, staged):
                (stage / "out" / "job.log").write_text(outcome.log)
                target = entry(name, task)
                if task.runs_ckptspec:
                    (stage / "out" / cache.MODULES).write_text(json.dumps(modules, indent=1))
                    target = cache.recorded_entry(name, task_key(name, task), modules)
                description = {
                    "name": name,
                    "kind": task.kind,
                    "args": task.normalized(),
                    "world_size": task.world_size,
                    "nodes": task.nodes,
                    "launch_seconds": outcome.seconds,
                    "launch_tasks": len(batch),
                }
                cache.publish(stage / "out", target, description)
    finally:
        for _, staged in planned:
            for stage in staged:
                shutil.rmtree(stage, ignore_errors=True)
    return done


def _job_args(task: Task) -> dict:
    args = task.normalized()
    if task.load:
        args = {**args, "load": str(path(task.load))}
    return args


def read_json(name: str, filename: str) -> dict:
    return json.loads((path(name) / filename).read_text())


def launched(tasks: dict[str, dict], world_size: int, failed_ok=None) -> dict[str, Path]:
    """The entries of job tasks run outside the registry (name -> ``{"kind", "args"}`` of
    job/main.py, or of a script of its own: ``LAUNCHED_SCRIPTS``), each in a launch of its own at ``world_size``;
    the missing ones built in one go,
    two at a time, forked from one process that imported torch and DeepSpeed once.

    Keyed as the registered tasks that run ckptspec: the task, the job code, the versions, and the
    files of the ckptspec modules the job imported (recorded, ``ckptspec-modules.json``). A failed
    launch raises, unless ``failed_ok(name, error, out)`` says it is the expected outcome (it may
    write into the entry's ``out``): then the entry is published as it is.
    """
    for name in tasks:
        guard.reached(f"the DeepSpeed job result {name!r}")
    keys = {name: _launched_key(task, world_size) for name, task in tasks.items()}
    found = {name: cache.find_recorded(name, key) for name, key in keys.items()}
    missing = sorted(name for name, entry in found.items() if entry is None)
    if missing:
        with contextlib.ExitStack() as locks:
            for name in missing:
                locks.enter_context(cache.locked(cache.entry(name, keys[name])))
            missing = [name for name in missing if cache.find_recorded(name, keys[name]) is None]
            stages = {name: cache.staging(cache.entry(name, keys[name])) for name in missing}
            try:
                launches = []
                for name, stage in stages.items():
                    (stage / "out").mkdir()
                    (stage / "imports").mkdir()
                    job = [{**tasks[name], "out": str(stage / "out" / "save")}]
                    script = LAUNCHED_SCRIPTS.get(tasks[name]["kind"], (JOB_MAIN,))[0]
                    launch = task_launch(job, world_size, stage, script)
                    args = [str(stage / "imports"), str(launch.script), *launch.args]
                    launches.append(replace(launch, script=RECORDER, args=args))
                for (name, stage), outcome in zip(stages.items(), run_launches(launches)):
                    if isinstance(outcome, HarnessError):
                        if failed_ok is None or not failed_ok(name, outcome, stage / "out"):
                            raise outcome
                    modules = sorted(record_imports.read(stage / "imports"))
                    (stage / "out" / cache.MODULES).write_text(json.dumps(modules, indent=1))
                    target = cache.recorded_entry(name, keys[name], modules)
                    cache.publish(stage / "out", target, {"name": name, "task": tasks[name], "world_size": world_size})
            finally:
                for stage in stages.values():
                    shutil.rmtree(stage, ignore_errors=True)
        found = {name: cache.find_recorded(name, key) for name, key in keys.items()}
    return found


def _launched_key(task: dict, world_size: int) -> str:
    identity = {
        "task": task,
        "world_size": world_size,
        "versions": cache.versions(),
        "job": cache.tree_digest(*cache.JOB_SOURCES),
        "ckptspec": cache.key({"recorder": RECORDER.read_text()}),  # the modules: the entry's suffix
    }
    if task["kind"] in LAUNCHED_SCRIPTS:  # its own script (the other kinds' keys stay as they were)
        identity["script"] = cache.key({p.name: p.read_text() for p in LAUNCHED_SCRIPTS[task["kind"]]})
    return cache.key(identity)


def cached(name: str, identity: dict, build, sources: list[Path] = ()) -> Path:
    """An entry made by ``build(directory, env)`` in the test process (an example run end to end),
    every Python process it starts run with ``env`` (launch.job_env, and the import recorder).

    The key: ``identity`` (what else the result depends on), the files under ``sources``, the job's
    site (site/), DeepSpeed's and torch's versions, and, as the jobs that run ckptspec, the files of
    the ckptspec modules its processes imported (record_site/sitecustomize.py records them).
    ``build`` raises on failure, and a failed build leaves nothing in the cache.
    """
    guard.reached(f"the DeepSpeed job result {name!r}")
    recorder = (RECORD_SITE / "sitecustomize.py").read_text() + RECORDER.read_text()
    own = {"sources": cache.tree_digest(*sources), "job": cache.tree_digest(*cache.JOB_SOURCES)}
    key = cache.key({**identity, **own, "versions": cache.versions(), "recorder": cache.key({"r": recorder})})
    found = cache.find_recorded(name, key)
    if found:
        return found
    with cache.locked(cache.entry(name, key)):
        found = cache.find_recorded(name, key)
        if found:
            return found
        stage = cache.staging(cache.entry(name, key))
        try:
            (stage / "imports").mkdir()
            env = job_env()
            env["PYTHONPATH"] = os.pathsep.join([str(RECORD_SITE), env["PYTHONPATH"]])
            env["CKPTSPEC_RECORD_IMPORTS"] = str(stage / "imports")
            build(stage / "out", env)
            modules = sorted(record_imports.read(stage / "imports"))
            (stage / "out" / cache.MODULES).write_text(json.dumps(modules, indent=1))
            target = cache.recorded_entry(name, key, modules)
            cache.publish(stage / "out", target, {"name": name, "identity": identity})
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return target

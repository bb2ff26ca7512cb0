"""The test harness as a pytest plugin (``pytest_plugins`` in tests/conftest.py): fixtures, and
the markers they put on the tests that use them.

Importing this module imports neither torch nor DeepSpeed: the unit tier (tests/unit) loads it in
an environment without them. A fixture that needs them imports them when it is first used.

=====================  ============================================================  ===========
fixture                what it gives                                                 marker
=====================  ============================================================  ===========
``ds_checkpoint``      ``ds_checkpoint(name)``: a real DeepSpeed job's entry          deepspeed
                       (tasks.py; built once, cached)
``ds``                 the job results module itself (``ds.path``, ``ds.read_json``)  deepspeed
``zero_to_fp32``       DeepSpeed's own zero_to_fp32, in the test process (oracles.py)  deepspeed
``fsdp2_launch``       ``fsdp2_launch(tasks, ws, workdir, env=)``: fsdp2_job.py's     deepspeed
                       tasks in one torchrun launch (a checkpoint the test made;
                       ``env``: a ``ds.cached`` build's, to cache it)
``committed``          ``committed(name)``: a real checkpoint committed in            (none)
                       tests/data (no DeepSpeed, no job)
``ckptspec_cli``       ``ckptspec_cli(*args)``: a command in-process (click's         (none)
                       runner); asserts exit 0
``ckptspec_process``   ``ckptspec_process(args, ...)``: a command in a process of     subprocess
                       its own, forked from the fork server (cli_process.run)
``crash``              crash.py: ``crash.run(args, failpoint)``, ``crash.steps``...  subprocess
``cli_server``         the fork server's socket (forkclient.py's                     subprocess
                       ``$CKPTSPEC_FORKSERVER``)
``nginx``, ``s3``,     real nginx and moto S3 servers on 127.0.0.1 (servers.py),     remote
``s3_env``             once per session; ``nginx.serve(dir)``, ``s3.upload(dir)``
``s3_factory``         ``s3_factory(env)``: another moto S3 server (e.g. with IAM)    remote
=====================  ============================================================  ===========

``-m 'not deepspeed'`` therefore selects what runs without a DeepSpeed job, ``-m 'not subprocess'``
what runs in-process only. The marker cannot be forgotten: a test that reaches a job's result or
DeepSpeed's zero_to_fp32 without carrying ``deepspeed`` fails (guard.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from . import guard

# Fixture -> the marker every test using it (directly or through another fixture) gets.
MARKED_BY = {
    "ds": "deepspeed",
    "ds_checkpoint": "deepspeed",
    "zero_to_fp32": "deepspeed",
    "fsdp2_launch": "deepspeed",
    "crash": "subprocess",
    "ckptspec_process": "subprocess",
    "cli_server": "subprocess",
    "torchrun": "subprocess",
    "nginx": "remote",
    "s3": "remote",
    "s3_factory": "remote",
    "s3_env": "remote",
}
# The _harness modules a test file may import: data and pure functions. Everything that starts a
# process, a server or a job, or hands out a job's result, a test reaches through a fixture above
# (cli_process, crash, servers, launch, tasks, cache, forkclient...), so that the fixture marks it.
# Checked by tests/unit/harness/test_imports.py; the harness's own tests (tests/test_harness.py,
# tests/unit/harness/) are exempt.
IMPORTABLE = {
    "scenarios": "every job's name and spec (data for parametrize; no job is reached by importing it)",
    "faults": "the fault corpus: mutations of a copy (its base reached through `ds`, given by the test)",
    "faults_masters": "the fault corpus of the masters index",
    "faults_parallel": "the fault corpus of the parallel checkpoints",
    "faults_copies": "the fault corpus of weights copied from another run",
    "states": "what a reader sees of a directory; which steps to stop a writer at",
    "before_load": "the values a target job's frozen parameters and buffers hold before it loads (noise)",
    "oracles": "DEEPSPEED_VERSION (its zero_to_fp32 is guarded: take the `zero_to_fp32` fixture)",
    "parallel_oracles": "readers and checkers of the oracles a parallel job recorded (torch only)",
    "reconstruction": "checkers of a reconstruction (bits, same_bits, check_reconstruction)",
    "job.model": "the jobs' model, built whole in the test (model and config keys)",
    "job.parallel_models": "the parallel jobs' models, built whole in the test",
    "job.tp_layers": "UNIVERSAL_INFO: the split rules the tensor-parallel pipeline job saves (data)",
    "fsdp2_job": "shared_batch, parallel_batch: the batches the FSDP2 job and the test both use",
    "dcp_oracles": "checkers of what an FSDP2 job loaded against the DeepSpeed job's oracles (torch only)",
    "compat": "the older DeepSpeed's version and the folder of its committed checkpoints (constants)",
}
MARKERS = {
    "deepspeed": "uses real DeepSpeed job results (tests/_harness; built once and cached) or DeepSpeed's zero_to_fp32; "
    "applied by its fixtures, required by the guard (guard.py)",
    "subprocess": "runs ckptspec in a process of its own (the fork server); applied by its fixtures",
    "remote": "reads through real nginx or S3 servers on 127.0.0.1; applied by its fixtures",
}


def pytest_configure(config):
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    guard.armed = True


def pytest_unconfigure(config):
    guard.armed = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The guard knows the test whose setup, call or teardown runs (module- and session-scoped
    fixtures run in the setup of the first test that uses them)."""
    guard.current = item
    try:
        return (yield)
    finally:
        guard.current = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A phase in which the guard refused something fails, even if the test caught the error."""
    report = yield
    refused = guard.take()
    if refused and report.passed:
        report.outcome = "failed"
        report.longrepr = "\n".join(refused)
    return report


# The files that take longest (a warm run's --durations, summed per file), run first: xdist hands whole files out in
# collection order (--dist loadfile), and these came near the end (test_remote_output 103rd of 116), so one worker
# ran the last of them while the other had nothing left.
LONGEST_FIRST = (
    "tests/remote/test_remote_output.py",
    "tests/cli/test_crash_safety.py",
    "tests/interop/test_node_reader_index.py",
    "tests/deepspeed/test_shards.py",
    "tests/checkpoint/test_torchfile_fuzz.py",
    "tests/remote/test_remote_index.py",
    "tests/test_docs.py",
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        for marker in sorted({MARKED_BY[f] for f in getattr(item, "fixturenames", ()) if f in MARKED_BY}):
            item.add_marker(marker)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    # a stable sort: each file's tests stay together and in order, the other files as collected
    items.sort(key=lambda item: rank.get(getattr(item, "nodeid", "").partition("::")[0], len(rank)))


@pytest.fixture(scope="session")
def ds():
    """Real DeepSpeed job results by name: ``ds.path("s2-bf16-ws2")`` (tests/_harness/tasks.py).

    Entries are cached in ``.cache/ds`` (or ``$CKPTSPEC_DS_CACHE``) and keyed on everything that
    runs inside the job; the first request builds every missing registered entry in batches.
    """
    from . import oracles, tasks

    oracles.check_deepspeed_version()  # a missing or other DeepSpeed is a broken environment, not a skip
    return tasks


@pytest.fixture(scope="session")
def ds_checkpoint(ds):
    """``ds_checkpoint(name)``: the entry of the registered DeepSpeed job ``name`` (scenarios.py)."""

    def path(name: str) -> Path:
        if name.startswith("committed:"):
            raise ValueError(f"{name}: a committed checkpoint needs no DeepSpeed; use the `committed` fixture")
        return ds.path(name)

    return path


@pytest.fixture(scope="session")
def zero_to_fp32():
    """DeepSpeed's own ``zero_to_fp32(save_dir)`` in the test process (oracles.py): the reference."""
    from .oracles import zero_to_fp32

    return zero_to_fp32


@pytest.fixture(scope="session")
def committed():
    """``committed(name)``: a real DeepSpeed checkpoint committed in tests/data (scenarios.COMMITTED)."""
    from .scenarios import COMMITTED

    return COMMITTED.__getitem__


@pytest.fixture(scope="session")
def ckptspec_cli():
    from .reconstruction import cli

    return cli


@pytest.fixture(scope="session")
def ckptspec_process():
    from .cli_process import run

    return run


@pytest.fixture(scope="session")
def torchrun():
    """launch.torchrun_command: ``torchrun(nproc, *args, env=None, nnodes=1)`` runs ``torchrun ARGS`` on 127.0.0.1,
    on CPU (``nnodes`` agents, as the nodes of one job)."""
    from .launch import torchrun_command

    return torchrun_command


@pytest.fixture(scope="session")
def fsdp2_launch():
    """``fsdp2_launch(tasks, world_size, workdir, env=None)``: fsdp2_job.py's tasks in one uncached torchrun launch
    (for loads of a checkpoint the test made, e.g. a corrupt copy; ``env``: a ``ds.cached`` build's, to cache it);
    returns the launch log, raises on a failed launch."""
    from .launch import FSDP2_MAIN, run_tasks

    def run(tasks: list[dict], world_size: int, workdir: Path, env: dict | None = None) -> str:
        return run_tasks(tasks, world_size, workdir, script=FSDP2_MAIN, env=env)

    return run


@pytest.fixture(scope="session")
def crash(ckptspec_process):
    """crash.py: a writer stopped at a chosen step (``run(args, failpoint)``, ``steps``, ``points``)."""
    from . import crash

    return crash


@pytest.fixture(scope="session")
def cli_server() -> Path:
    from .cli_process import SERVER

    return SERVER.address()


@pytest.fixture(scope="session")
def nginx(tmp_path_factory):
    from .servers import start_nginx

    server = start_nginx(tmp_path_factory.mktemp("nginx"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    from .servers import start_s3

    server = start_s3(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_factory(tmp_path_factory):
    """``s3_factory(env=None)``: another moto S3 server (``env``: moto's settings, e.g. IAM), stopped at the end."""
    from .servers import start_s3

    started = []

    def start(env: dict[str, str] | None = None):
        started.append(start_s3(tmp_path_factory.mktemp("moto"), env))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def s3_env(s3, monkeypatch) -> dict[str, str]:
    """The environment a user sets to reach the S3 server (credentials and endpoint), for this test."""
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    return s3.env

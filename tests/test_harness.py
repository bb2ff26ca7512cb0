"""The real-DeepSpeed harness itself: its oracles agree with DeepSpeed's, and its cache is sound."""

import inspect
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from _harness import cache, scenarios
from _harness.oracles import DEEPSPEED_VERSION
from _harness.tasks import Task, task_key


def _apart_in_eps_of_largest(a, b) -> float:
    """The largest elementwise difference, in fp32 epsilons (2**-23) of ``b``'s largest magnitude (0: equal)."""
    import torch

    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
    largest = float(b.abs().max()) if b.numel() else 0.0
    return float((a - b).abs().max()) / (largest * 2**-23) if largest else float((a - b).abs().max())


def _bits_equal(a, b) -> bool:
    import torch

    # Raw bits, so -0.0 vs 0.0 or NaN payloads would count as different.
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_stage2_checkpoint_matches_live_engine(zero_to_fp32, ds):
    import torch

    save_dir = ds.path("s2-bf16-ws2")
    info = json.loads((save_dir / "harness.json").read_text())
    assert info["deepspeed_version"] == DEEPSPEED_VERSION
    assert (save_dir / "latest").read_text() == info["tag"] == "global_step2"
    assert sorted(p.name for p in (save_dir / info["tag"]).iterdir()) == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "mp_rank_00_model_states.pt",
    ]
    live = torch.load(save_dir / "live_fp32.pt", weights_only=True)
    ref = zero_to_fp32(save_dir)
    # Trainable params only (frozen.* and buffers are not in live_fp32.pt), tied alias included.
    assert sorted(live) == ["emb.weight", "head.weight", "l1.bias", "l1.weight", "l2.bias", "l2.weight"]
    for name, tensor in live.items():
        assert tensor.dtype == torch.float32 and _bits_equal(tensor, ref[name]), name


def test_live_masters_agree_with_deepspeeds_own_getter(ds):
    """The harness reads stage 1/2 masters from the flat buffers; DeepSpeed's safe_get_full_fp32_param agrees,
    except with round robin, where its mapping ignores the reordering (why the harness does not use it)."""
    for name in scenarios.MATRIX:
        info = json.loads((ds.path(name) / "harness.json").read_text())
        spec = info["spec"]
        mismatches = info["safe_get_full_fp32_param_mismatches"]
        if spec["stage"] in (1, 2) and spec["round_robin"]:
            assert mismatches, name
        else:
            assert mismatches == [], name


@pytest.mark.parametrize("name", scenarios.MATRIX)
def test_a_job_gives_the_same_masters_in_any_launch(ds, name):
    """The ``+engine`` entry re-trains the job in another launch, among other tasks: same bits."""
    import torch

    first = torch.load(ds.path(name) / "live_fp32.pt", weights_only=True)
    again = torch.load(ds.path(scenarios.engine_name(name)) / "live_fp32.pt", weights_only=True)
    assert sorted(first) == sorted(again)
    assert all(_bits_equal(first[n], again[n]) for n in first)


def test_cache_key_ignores_spelled_out_defaults_and_follows_real_changes():
    spec, world_size = scenarios.MATRIX_SPECS["s2-bf16-ws2"]
    base = task_key("x", Task("train", spec, world_size))
    assert task_key("x", Task("train", dict(spec, steps=2, hooks=[]), world_size)) == base
    assert task_key("x", Task("train", dict(spec, steps=3), world_size)) != base
    assert task_key("x", Task("train", spec, world_size + 1)) != base
    # ckptspec's sources are in the key of exactly the tasks that run ckptspec inside the job.
    assert not Task("train", spec, world_size).runs_ckptspec
    assert Task("train", dict(spec, hooks=["engine_manifest"]), world_size).runs_ckptspec
    assert Task("train", dict(spec, save_with="ckptspec"), world_size).runs_ckptspec


def test_entries_are_complete_and_named_for_their_task(ds):
    path = ds.path("s2-bf16-ws2")
    assert path.parent == cache.root() and cache.is_done(path)
    description = json.loads((path / cache.DONE).read_text())
    assert description["name"] == "s2-bf16-ws2" and description["world_size"] == 2


@pytest.mark.parametrize("name", sorted(scenarios.COMMITTED))
def test_committed_checkpoints_are_what_the_harness_builds(ds, name):
    """tests/data/deepspeed-0.19.8 (the synthetic fault route's bases) is refreshed by
    ``scripts/compat.sh --refresh``: the same masters and layout as the job writes now."""
    import torch

    from ckptspec.deepspeed.describe import describe

    built, committed = ds.path(name), scenarios.COMMITTED[name]
    fresh = torch.load(built / "live_fp32.pt", weights_only=True)
    kept = torch.load(committed / "live_fp32.pt", weights_only=True)
    # Within 4 epsilons of each tensor's largest master, not bit for bit: the same job on another CPU rounds a few
    # fp32 masters differently (measured: a machine with AMX and AVX512-BF16 held 59 of 2705 masters, in 4 of the 6
    # tensors, at most 6e-8 or 0.65 epsilon of the largest from the committed ones, whatever oneDNN, ATen or MKL ISA it
    # was pinned to). A changed job (another seed, step or learning rate) moves them by thousands of epsilons.
    assert sorted(fresh) == sorted(kept) and all(_apart_in_eps_of_largest(fresh[k], kept[k]) <= 4 for k in kept)
    layouts = [describe(d).to_dict() for d in (built, committed)]
    assert [{k: v for k, v in doc.items() if k != "producer"} for doc in layouts][0] == {
        k: v for k, v in layouts[1].items() if k != "producer"
    }


RANKS_ENV_SCRIPT = (  # a job script that writes what its rank was started with (ranks.py's preloads first)
    "import json, os, sys\n"
    "sys.path.insert(0, sys.argv[2])\n"
    "import ranks\n"
    "ranks.preload()\n"
    "out = os.path.join(sys.argv[1], 'rank' + os.environ['RANK'] + '.json')\n"
    "json.dump({'env': dict(os.environ), 'name': __name__, 'argv': sys.argv[1:]}, open(out, 'w'))\n"
)


def _launchers_started(directory, _env) -> None:
    """Both launchers run RANKS_ENV_SCRIPT on two ranks; kept per launcher and rank: the script's ``__name__``, its
    arguments (the output folder as ``{out}``, job/ as ``{job}``), ``MASTER_PORT`` beside the test environment's,
    and the variables it set (those whose values differ from launch.job_env's; the environment itself is not kept)."""
    from _harness.launch import RANKS, Done, Launch, job_env, run_launches, run_torchrun

    script = directory / "ranks_env.py"
    directory.mkdir()
    script.write_text(RANKS_ENV_SCRIPT)
    env = job_env()
    kept = {}
    for launcher in ("torchrun", "ranks"):
        out = directory / launcher
        out.mkdir()
        args = [str(out), str(RANKS.parent)]
        if launcher == "torchrun":
            run_torchrun(script, args, 2)
        else:
            (outcome,) = run_launches([Launch(script, args, 2, out)])
            assert isinstance(outcome, Done), outcome
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        kept[launcher] = [
            {
                "name": r["name"],
                "argv": [{str(out): "{out}", str(RANKS.parent): "{job}"}.get(a, a) for a in r["argv"]],
                "ports": [r["env"]["MASTER_PORT"], env.get("MASTER_PORT")],
                "added": {k: v for k, v in r["env"].items() if env.get(k) != v and k != "MASTER_PORT"},
            }
            for r in ranks
        ]
        shutil.rmtree(out)
    (directory / "launchers.json").write_text(json.dumps(kept, indent=1))


def test_forked_ranks_get_what_torchrun_gives_its_ranks(ds):  # ds: its launches import DeepSpeed
    """The harness's launches (``run_launches``: job/ranks.py) start each rank with torchrun's
    environment (the elastic agent's own TORCHELASTIC_* and NCCL variables aside) and run the
    script as ``__main__`` with its arguments. The script imports what ranks.py preloads first, as
    every job does (torch and DeepSpeed set a few variables of their own when imported).

    Cached (``ds.cached``): keyed on launch.py, this script and what records it, with the job's code (ranks.py) and
    torch's and DeepSpeed's versions."""
    from _harness import launch

    code = {"launch": Path(launch.__file__).read_text(), "build": inspect.getsource(_launchers_started)}
    entry = ds.cached("launchers-env", {"script": RANKS_ENV_SCRIPT, **code}, _launchers_started)
    kept = json.loads((entry / "launchers.json").read_text())
    added = {}  # launcher -> per rank, the variables it set (MASTER_PORT apart: a free port each time)
    for launcher, ranks in kept.items():
        assert [(r["name"], r["argv"]) for r in ranks] == [("__main__", ["{out}", "{job}"])] * 2
        (port, test_port), (other, _) = ranks[0]["ports"], ranks[1]["ports"]
        assert port == other != test_port
        added[launcher] = [r["added"] for r in ranks]
    agent_only = ("TORCHELASTIC_", "TORCH_NCCL_")
    assert [{k: v for k, v in r.items() if not k.startswith(agent_only)} for r in added["torchrun"]] == added["ranks"]
    assert [r["RANK"] for r in added["ranks"]] == ["0", "1"]


def test_an_http_reader_load_is_keyed_on_the_server_it_starts(tmp_path, monkeypatch):
    """Rank 0 of an FSDP2 "http" load starts nginx with servers.py: an edit to it rebuilds that entry, and only it."""
    from _harness import tasks

    # without the entry they load, whose key is in theirs once it is built (a cold cache has none)
    registry = {n: replace(t, load=None) for n, t in scenarios.REGISTRY.items() if t.kind == "fsdp2"}
    http = next(n for n, t in registry.items() if t.args.get("http"))
    local = next(n for n, t in registry.items() if not t.args.get("http"))
    before = {n: task_key(n, registry[n]) for n in (http, local)}
    edited = tmp_path / "servers.py"
    edited.write_text(tasks.SERVERS.read_text() + "\n# edited\n")
    monkeypatch.setattr(tasks, "SERVERS", edited)
    assert task_key(http, registry[http]) != before[http]
    assert task_key(local, registry[local]) == before[local]


def test_a_launch_that_fails_in_one_task_fails_that_task_alone(tmp_path, monkeypatch):
    """A launch that fails in its second task (a mutation made that job fail): the first task, completed on every
    rank, is published; the second fails with the launch's error, its own, which ``path`` raises at once (before,
    every task of the launch failed and each was run again alone, a launch each); the third, never started, runs in
    the next launch. Measured on a real launch of six ws2 trainings, the second broken: 83 s -> 29 s to the error and
    the other five entries (CHANGELOG)."""
    from _harness import launch, tasks

    monkeypatch.setenv("CKPTSPEC_DS_CACHE", str(tmp_path / "cache"))
    names = [n for n, t in scenarios.REGISTRY.items() if t.kind == "train" and t.world_size == 2 and not t.load][:3]
    names = [n for n in names if scenarios.REGISTRY[n].launch_group == scenarios.REGISTRY[names[0]].launch_group]
    assert len(names) == 3
    monkeypatch.setattr(tasks, "_registry", lambda: {n: scenarios.REGISTRY[n] for n in names})
    monkeypatch.setattr(tasks, "_FAILED", {})
    monkeypatch.setattr(tasks, "_OWN_ERROR", set())
    monkeypatch.setattr(tasks, "guard", type("Off", (), {"reached": staticmethod(lambda what: None)}))
    launched: list[list[str]] = []

    def run_launches(launches, python, jobs):
        """The ranks' side of each launch: the tasks up to the broken one run (their outs written), then it fails."""
        outcomes = []
        for ln in launches:
            job = json.loads(Path(ln.args[ln.args.index("--tasks") + 1]).read_text())
            launched.append([Path(t["out"]).parent.name for t in job])
            log = []
            for t in job:
                log += [f"[harness] rank {r}: {t['kind']} -> {t['out']}\n" for r in (0, 1)]
                if names[1] in Path(t["out"]).parent.name:
                    ln.log.write_text("".join(log) + "KeyError: 'exp_avg_sq'\n")
                    outcomes.append(launch.HarnessError(f"{ln.what} failed (exit 1):\nKeyError: 'exp_avg_sq'"))
                    break
                Path(t["out"]).mkdir()
                (Path(t["out"]) / "done").write_text(t["kind"])
            else:
                ln.log.write_text("".join(log))
                outcomes.append(launch.Done("".join(log), 1.0))
        return outcomes

    monkeypatch.setattr(tasks, "run_launches", run_launches)
    assert (tasks.path(names[0]) / "done").read_text() == "train"
    assert len(launched) == 2 and len(launched[0]) == 3 and len(launched[1]) == 1 and names[2] in launched[1][0]
    monkeypatch.setattr(tasks, "_launch_all", lambda *a: pytest.fail("the failed task was run again"))
    with pytest.raises(launch.HarnessError, match=rf"task {names[1]} failed[\s\S]*KeyError: 'exp_avg_sq'"):
        tasks.path(names[1])
    assert (tasks.path(names[2]) / "done").read_text() == "train"

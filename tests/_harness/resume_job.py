"""The validated resume, ``ckptspec.deepspeed.load_checkpoint``, in a real job (issue #43): a launch of its own.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/_harness/resume_job.py --tasks TASKS.json

A task (``{"kind": "validated_resume", "args": {"spec", "load", "scenarios"}, "out"}``) names the save directory of
a ``save_crash`` job (``load``: its complete tags ``first`` and ``second``, and ``masters.pt``, the fp32 masters
the job held at each save) and the spec it ran (job/model.py). Each scenario (``{"name", "faults", "tag",
"fallback"}``) is a run rank 0 builds in OUT/<name>/run: ``global_step1`` a copy of ``first``, ``global_step2`` of
``second``, then ``faults`` (``{"global_step2": ["truncate" | "remove", FILE]}``: the tag's FILE cut to half its
size, or removed). Every rank then builds a fresh engine of the spec, fills its frozen parameters and buffers with
values no checkpoint holds (before_load.py), and calls ``load_checkpoint(engine, RUN, tag, fallback)``, with every
file DeepSpeed reads recorded (``engine.checkpoint_engine.load``, through which DeepSpeed reads every states file).

Each rank writes OUT/<name>.rank<R>.json:

  error         the exception load_checkpoint raised: class, code, message, findings (dicts); or null
  tag, skipped  the Resumed it returned: the tag loaded, the tags skipped ([tag, code] newest first); or null
  warned        the warnings load_checkpoint gave (their messages)
  read          the files DeepSpeed read, relative to the run
  untouched     the fp32 masters and the module's state dict are still those held before the call
  first_mismatched   names whose fp32 masters (job/model.py live_fp32) differ from ``first``'s in masters.pt
  getter_fp32_mismatched / getter_optim_mismatched   names (name.state) whose safe_get_full_fp32_param /
                safe_get_full_optimizer_state differ, bit for bit, from those of a reference engine into which
                DeepSpeed's own engine.load_checkpoint(load, tag="first") loaded the untouched tag (null after
                an error: there is no state to get)
  client_state  the keys of the client state returned
"""

import gc
import json
import shutil
import sys
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make `_harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness.before_load import unlike_any_checkpoint
from _harness.job.main import reset_deepspeed_globals, serve
from _harness.job.model import build_model, ds_config, live_fp32, normalize_spec, param_groups

STATES = ("exp_avg", "exp_avg_sq")


def _engine(spec):
    import deepspeed
    import torch

    reset_deepspeed_globals()
    torch.manual_seed(spec["seed"])
    model = build_model(spec)
    optimizer = torch.optim.AdamW(param_groups(model, spec), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(spec))
    return engine, model


def _getters(engine, model) -> dict:
    """name -> fp32 master, name.state -> Adam moment, as DeepSpeed's getters give them (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked"):  # links rebuilt after a load, as job/resume.py does
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    got = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        got[name] = safe_get_full_fp32_param(p)
        for state in STATES:
            got[f"{name}.{state}"] = safe_get_full_optimizer_state(p, state)
    return got


def _differ(a: dict, b: dict) -> list:
    import torch

    return sorted(
        n
        for n in set(a) | set(b)
        if a.get(n) is None or b.get(n) is None or a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])
    )


def _build_run(load: Path, run: Path, faults: dict) -> None:
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(load / "first", run / "global_step1")
    shutil.copytree(load / "second", run / "global_step2")
    for tag, (fault, name) in faults.items():
        target = run / tag / name
        if fault == "truncate":
            target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
        elif fault == "remove":
            target.unlink()
        else:
            raise ValueError(f"unknown fault {fault!r}")
    (run / "latest").write_text("global_step2")


def _scenario(spec, load: Path, scenario: dict, out: Path, reference: dict, first: dict) -> dict:
    import torch.distributed as dist

    from ckptspec.deepspeed import load_checkpoint

    run = out / scenario["name"] / "run"
    if dist.get_rank() == 0:
        _build_run(load, run, scenario["faults"])
    dist.barrier()
    engine, model = _engine(spec)
    unlike_any_checkpoint(model)
    before_masters = live_fp32(engine, model, spec["stage"])
    before_module = {k: v.detach().clone() for k, v in model.state_dict().items()}
    read = []
    deepspeed_load = engine.checkpoint_engine.load

    def recorded(path, *args, **kwargs):
        read.append(str(Path(path).resolve().relative_to(run.resolve())))
        return deepspeed_load(path, *args, **kwargs)

    engine.checkpoint_engine.load = recorded
    result = {"error": None, "tag": None, "skipped": None, "client_state": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            resumed = load_checkpoint(engine, str(run), tag=scenario["tag"], fallback=scenario["fallback"])
            result["tag"], result["client_state"] = resumed.tag, sorted(resumed.client_state or {})
            result["skipped"] = [[s.tag, s.code] for s in resumed.skipped]
        except Exception as exc:  # the outcome under test: recorded, and every rank goes on
            findings = [f.to_dict() for f in getattr(exc, "findings", None) or []]
            result["error"] = {
                "class": type(exc).__name__,
                "code": getattr(exc, "code", None),
                "message": str(exc),
                "findings": findings,
            }
    result["warned"] = [str(w.message) for w in caught if "ckptspec" in str(w.message)]
    result["read"] = sorted(read)
    masters = live_fp32(engine, model, spec["stage"])
    module = model.state_dict()
    result["untouched"] = not _differ(masters, before_masters) and not _differ(module, before_module)
    result["first_mismatched"] = _differ(masters, first)
    # Only after a load: with no optimizer state, the getter fails on the ranks holding a fragment of the parameter
    # and not on the others (collective), which would stop the job rather than record the refusal.
    differ = _differ(_getters(engine, model), reference) if result["error"] is None else None
    result["getter_fp32_mismatched"] = differ and [n for n in differ if not n.endswith(STATES)]
    result["getter_optim_mismatched"] = differ and [n for n in differ if n.endswith(STATES)]
    if hasattr(engine, "destroy"):
        engine.destroy()
    return result


def run(args, out: Path):
    import torch
    import torch.distributed as dist

    spec, load = normalize_spec(args["spec"]), Path(args["load"])
    out.mkdir(parents=True, exist_ok=True)
    engine, model = _engine(spec)  # the reference: DeepSpeed's own load of the untouched older tag
    engine.load_checkpoint(str(load), tag="first")
    reference = {n: t.clone() for n, t in _getters(engine, model).items()}
    if hasattr(engine, "destroy"):
        engine.destroy()
    first = torch.load(load / "masters.pt", map_location="cpu", weights_only=True)["first"]
    for scenario in args["scenarios"]:
        result = _scenario(spec, load, scenario, out, reference, first)
        (out / f"{scenario['name']}.rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
        dist.barrier()
        gc.collect()


def main():
    serve(lambda task: run(task["args"], Path(task["out"])), reset=False)


if __name__ == "__main__":
    main()

"""The optimizer state of a universal folder's source as DeepSpeed holds it (issue #39): a launch of its own
for "optim_universal" tasks.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node N tests/_harness/optim_universal_job.py --tasks TASKS.json

A task (``{"kind": "optim_universal", "args": {"spec", "source", "load"}, "out"}``) names a dense "parallel"
entry trained with ``universal`` (``load``: the ZeRO tag ``latest`` names, and beside it the folder
``ds_to_universal`` wrote, ``latest_universal``). Every rank builds the engine of the spec twice (no
training step) and records, per trainable parameter, the optimizer state the live engine holds after

* ``source``: ``engine.load_checkpoint(load)``, the ZeRO tag the folder was converted from (what the run
  itself held when it saved);
* ``universal``: the same engine with ``checkpoint.load_universal: true``, loading the universal folder
  (DeepSpeed's own reader of the folder's ``zero/<param>/*.pt`` and ``zero/optimizer_state.pt``).

Each load's record, ``OUT/<load>.rank<R>.pt``, has optim_job.py's keys: ``state`` (name ->
{"exp_avg", "exp_avg_sq"}: ``safe_get_full_optimizer_state``, fp32, in the parameter's shape), ``step``
(name -> the torch optimizer's ``step`` of the flat partition holding it), ``group`` (name -> the index of
that partition's torch param group), ``param_groups`` (without ``params``). rank 0 writes ``OUT/optim.json``:
``load``, and ``errors``: load -> its error, or None.

optim_job.py (the other kinds' "optim" tasks) does not know ZeRO-3's partitioned parameters; it is left
as it is so that its entries keep their keys.
"""

import gc
import json
import sys
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make `_harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness.job.main import reset_deepspeed_globals, serve
from _harness.job.parallel_models import build_model, ds_config, normalize

KEYS = ("exp_avg", "exp_avg_sq")
LOADS = ("source", "universal")


def _engine(spec, universal: bool):
    import deepspeed
    import torch

    torch.manual_seed(spec["seed"])
    model = build_model(spec)
    optimizer = torch.optim.Adam([{"params": [p for p in model.parameters() if p.requires_grad]}], lr=1e-2)
    config = ds_config(spec)
    if universal:
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _partitions(opt) -> dict:
    """id(param) -> (torch param group, the fp32 flat partition whose torch state holds its moments and step)."""
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3: one flat partition per sub-group
        flat, to_group = opt.fp32_partitioned_groups_flat, opt.sub_group_to_group_id
        return {id(p): (to_group[i], flat[i]) for i, group in enumerate(opt.fp16_groups) for p in group}
    parts = opt.single_partition_of_fp32_groups
    return {id(p): (g, parts[g]) for g, group in enumerate(opt.bit16_groups) for p in group}


def _record(engine) -> dict:
    from deepspeed.utils import safe_get_full_optimizer_state

    opt = engine.optimizer
    inner = opt.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked"):  # ZeRO 1/2 after load_checkpoint: link to the loaded state
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    parts = _partitions(opt)
    record: dict = {"state": {}, "step": {}, "group": {}}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        shape = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3: the parameter's own shape is partitioned away
        answers = {k: safe_get_full_optimizer_state(p, k) for k in KEYS}  # collective
        assert all(a is not None for a in answers.values()), f"no optimizer state of {name}"
        record["state"][name] = {k: a.detach().clone().float().reshape(shape) for k, a in answers.items()}
        g, part = parts[id(p)]
        record["step"][name] = float(inner.state[part]["step"])
        record["group"][name] = g
    record["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return record


def run(args, out: Path):
    import torch
    import torch.distributed as dist

    spec = normalize({**args["spec"], "steps": 0, "save": False, "universal": False})
    rank = dist.get_rank()
    out.mkdir(parents=True, exist_ok=True)
    errors = {}
    for load in LOADS:
        reset_deepspeed_globals()
        engine = _engine(spec, load == "universal")
        try:
            load_path, _ = engine.load_checkpoint(args["load"])
            assert load_path is not None, f"DeepSpeed loaded nothing from {args['load']}"
            record = _record(engine)
            torch.save(record, out / f"{load}.rank{rank}.pt")
            errors[load] = None
        except Exception as exc:  # recorded: the tests assert there is none
            traceback.print_exc()
            errors[load] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine
        gc.collect()
    if rank == 0:
        (out / "optim.json").write_text(json.dumps({"load": args["load"], "errors": errors}, indent=1))
    dist.barrier()


def main():
    serve(lambda task: run(task["args"], Path(task["out"])), reset=False)


if __name__ == "__main__":
    main()

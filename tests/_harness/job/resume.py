"""Task "resume": load a saved checkpoint with real DeepSpeed, and check what was really loaded.

``args``: ``spec`` (model.DEFAULTS; the job is built like a "train" job of that spec: same model,
config and param groups), ``load`` (a save directory written by a "train" task, with its
``live_fp32.pt``) and ``change`` (alters the model: ``add_param`` adds a Linear ``extra``,
``widen_l2`` gives ``l2`` two more outputs). ``engine.load_checkpoint(load)`` runs with DeepSpeed's
defaults (strict module load, optimizer states loaded). Rank 0 writes into OUT:

  manifest.json  the job's layout before loading (ckptspec.deepspeed.manifest_from_engine)
  layout/        instead, where manifest_from_engine cannot describe the engine (ZeRO stage 0): the
                 job's own checkpoint, saved before loading (tag ``layout``), which describes it
  resume.json    loaded: load_checkpoint returned a path and raised nothing
                 error: "ExceptionType: first line of the message", or null
                 consistent: every fp32 master of the job equals the saved run's live master
                   (``live_fp32.pt``, written just before saving), for every name saved;
                   DeepSpeed can "load" and still leave wrong masters
                 mismatched: names whose masters are missing, reshaped or differ

With ``reshard`` (``{"world_size": N, "stage": S, "sub_group_size": G}``), the job's frozen parameters and
buffers are first filled with noise (_harness/before_load.py), then rank 0 runs ``ckptspec.export.reshard``
on ``load`` into OUT/resharded and every rank loads that instead (the job's own world size and
spec are the target's). With ``extra_step`` (``{"global_batch": G}``), one more training step
follows the checks, on G samples split evenly over the ranks (each sample seeded by its index in
the global batch: the same data whatever the world size), and rank 0 saves the masters after it
as ``after_step.pt``. resume.json then also holds:

                 reshard_error: ckptspec's error, or null
                 optim_consistent / optim_mismatched: the optimizer state per param (read from the
                   live flat buffers, model.live_optimizer_state) equals the saved run's
                   ``live_optim.pt``, and so does every group's step
                 getter_fp32_mismatched / getter_optim_mismatched: names where DeepSpeed's
                   safe_get_full_fp32_param / safe_get_full_optimizer_state (links rebuilt with
                   _lazy_init_hp_params_optimizer_state) differ from the saved run's live values
                 global_steps, skipped_steps, loss_scale: as the engine holds them after loading

and with ``reshard``, job/model_checks.py's: frozen_checked, buffers_checked, model_mismatched,
tied_checked, tied_mismatched (frozen parameters, buffers and ties against the source).
"""

import json
from pathlib import Path

from _harness.job.model import (
    DIM,
    HIDDEN,
    SEQ,
    VOCAB,
    build_model,
    ds_config,
    live_fp32,
    live_optimizer_state,
    normalize_spec,
    param_groups,
)
from _harness.job.model_checks import model_checks

CHANGES = ("add_param", "widen_l2")


def _changed_model(spec, change):
    from torch import nn

    model = build_model(spec)
    if change.get("add_param"):
        model.extra = nn.Linear(DIM, 3)
    if change.get("widen_l2"):
        model.l2 = nn.Linear(HIDDEN, DIM + 2)
    return model


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def run(args, out: Path):
    import deepspeed
    import torch
    import torch.distributed as dist

    from ckptspec.deepspeed import UnsupportedEngine, manifest_from_engine

    spec, change, load = normalize_spec(args["spec"]), dict(args.get("change") or {}), Path(args["load"])
    unknown = set(change) - set(CHANGES)
    if unknown:
        raise ValueError(f"unknown change keys: {sorted(unknown)}")
    torch.manual_seed(spec["seed"])
    rank = dist.get_rank()
    model = _changed_model(spec, change)
    optimizer = torch.optim.AdamW(param_groups(model, spec), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(spec))

    try:
        manifest = manifest_from_engine(engine).to_dict()
    except UnsupportedEngine:  # ZeRO stage 0 (a checkpoint index): B's layout is a save of B's own
        manifest = None
        engine.save_checkpoint(str(out / "layout"), tag="layout")
    error = reshard_error = None
    load_path = None
    reshard = args.get("reshard")
    if reshard:
        # The job shares the source's seed: only noise makes a frozen parameter or buffer the load left alone
        # differ from the source's (model_checks then names it)
        from _harness.before_load import unlike_any_checkpoint

        unlike_any_checkpoint(model)
        reshard_error, load = _reshard(load, out, reshard, rank)
    if reshard_error is None:
        try:
            load_path, _ = engine.load_checkpoint(str(load))
        except Exception as exc:  # the outcome under test: record it, do not crash
            error = _first_line(exc)

    source = Path(args["load"])
    live = live_fp32(engine, model, spec["stage"])  # collective: every rank
    saved = torch.load(source / "live_fp32.pt", map_location="cpu", weights_only=True)
    mismatched = sorted(
        n for n, t in saved.items() if n not in live or live[n].shape != t.shape or not torch.equal(live[n], t.float())
    )
    result = {
        "loaded": error is None and reshard_error is None and load_path is not None,
        "error": error,
        "reshard_error": reshard_error,
        "mismatched": mismatched,
    }
    result["consistent"] = result["loaded"] and not mismatched
    if reshard or args.get("extra_step"):
        result.update(_optimizer_checks(engine, model, spec["stage"], source, saved))
    if reshard and result["loaded"]:  # frozen parameters, buffers and ties (model_checks.py)
        result.update(model_checks(model, spec["stage"], source, saved))
    after = _extra_step(engine, model, spec, args["extra_step"]) if args.get("extra_step") else None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if manifest is not None:
            (out / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
        (out / "resume.json").write_text(json.dumps(result, indent=1, sort_keys=True))
        if after is not None:
            torch.save(after, out / "after_step.pt")
    dist.barrier()
    if hasattr(engine, "destroy"):
        engine.destroy()


def _reshard(load: Path, out: Path, reshard: dict, rank: int):
    """Rank 0 reshards ``load`` into OUT/resharded; every rank learns the outcome (error or None, path)."""
    import torch.distributed as dist

    target = out / "resharded"
    outcome = [None]
    if rank == 0:
        from ckptspec.export.reshard import reshard as run_reshard

        out.mkdir(parents=True, exist_ok=True)
        try:
            run_reshard(
                load,
                target,
                reshard["world_size"],
                zero_stage=reshard.get("stage"),
                sub_group_size=reshard.get("sub_group_size"),
            )
        except Exception as exc:  # recorded: a test asserts there is none
            outcome[0] = _first_line(exc)
    dist.broadcast_object_list(outcome, src=0)
    return outcome[0], target


def _optimizer_checks(engine, model, stage, source: Path, saved_fp32: dict) -> dict:
    """The loaded optimizer state against the saved run's live values (collective)."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    saved = torch.load(source / "live_optim.pt", map_location="cpu", weights_only=True)
    live = live_optimizer_state(engine, model, stage)
    bad = sorted(
        f"{n}.{k}"
        for n, states in saved["state"].items()
        for k, t in states.items()
        if n not in live["state"] or k not in live["state"][n] or not torch.equal(live["state"][n][k], t)
    )
    if live["steps"] != saved["steps"]:
        bad.append(f"steps {live['steps']} != {saved['steps']}")
    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    getter_fp32, getter_optim = [], []
    for n, p in model.named_parameters(remove_duplicate=False):  # collective: same order on every rank
        if n in saved_fp32:
            t = safe_get_full_fp32_param(p)
            if t is None or not torch.equal(t.float(), saved_fp32[n].float()):
                getter_fp32.append(n)
        for k, ref in sorted(saved["state"].get(n, {}).items()):
            t = safe_get_full_optimizer_state(p, k)
            if t is None or not torch.equal(t.float(), ref):
                getter_optim.append(f"{n}.{k}")
    scaler = getattr(opt, "loss_scaler", None)
    return {
        "optim_mismatched": bad,
        "optim_consistent": not bad,
        "getter_fp32_mismatched": getter_fp32,
        "getter_optim_mismatched": getter_optim,
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "loss_scale": float(scaler.cur_scale) if scaler is not None else None,
    }


def _extra_step(engine, model, spec, extra: dict) -> dict:
    """One training step on a global batch split over the ranks; the fp32 masters after it."""
    import torch
    import torch.distributed as dist

    total, world, rank = extra["global_batch"], dist.get_world_size(), dist.get_rank()
    if total % world:
        raise ValueError(f"global batch {total} does not split over {world} ranks")
    share = total // world
    tokens, targets = [], []
    for i in range(rank * share, (rank + 1) * share):
        g = torch.Generator().manual_seed(spec["seed"] + 100_000 + i)
        tokens.append(torch.randint(0, VOCAB, (SEQ,), generator=g))
        targets.append(torch.randint(0, VOCAB, (SEQ,), generator=g))
    loss = engine(torch.stack(tokens), torch.stack(targets))
    engine.backward(loss)
    engine.step()
    return live_fp32(engine, model, spec["stage"])

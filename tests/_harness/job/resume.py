"""Task "resume": load a saved checkpoint with real DeepSpeed, and check what was really loaded.

``args``: ``spec`` (model.DEFAULTS; the job is built like a "train" job of that spec: same model,
config and param groups), ``load`` (a save directory written by a "train" task, with its
``live_fp32.pt``) and ``change`` (alters the model: ``add_param`` adds a Linear ``extra``,
``widen_l2`` gives ``l2`` two more outputs). ``engine.load_checkpoint(load)`` runs with DeepSpeed's
defaults (strict module load, optimizer states loaded). Rank 0 writes into OUT:

  manifest.json  the job's layout before loading (ckptspec.deepspeed.manifest_from_engine)
  resume.json    loaded: load_checkpoint returned a path and raised nothing
                 error: "ExceptionType: first line of the message", or null
                 consistent: every fp32 master of the job equals the saved run's live master
                   (``live_fp32.pt``, written just before saving), for every name saved;
                   DeepSpeed can "load" and still leave wrong masters
                 mismatched: names whose masters are missing, reshaped or differ
"""

import json
from pathlib import Path

from _harness.job.model import DIM, HIDDEN, build_model, ds_config, live_fp32, normalize_spec, param_groups

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

    from ckptspec.deepspeed import manifest_from_engine

    spec, change, load = normalize_spec(args["spec"]), dict(args.get("change") or {}), Path(args["load"])
    unknown = set(change) - set(CHANGES)
    if unknown:
        raise ValueError(f"unknown change keys: {sorted(unknown)}")
    torch.manual_seed(spec["seed"])
    rank = dist.get_rank()
    model = _changed_model(spec, change)
    optimizer = torch.optim.AdamW(param_groups(model, spec), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(spec))

    manifest = manifest_from_engine(engine).to_dict()
    error = None
    load_path = None
    try:
        load_path, _ = engine.load_checkpoint(str(load))
    except Exception as exc:  # the outcome under test: record it, do not crash
        error = _first_line(exc)

    live = live_fp32(engine, model, spec["stage"])  # collective: every rank
    saved = torch.load(load / "live_fp32.pt", map_location="cpu", weights_only=True)
    mismatched = sorted(
        n for n, t in saved.items() if n not in live or live[n].shape != t.shape or not torch.equal(live[n], t.float())
    )
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
        result = {
            "loaded": error is None and load_path is not None,
            "error": error,
            "consistent": error is None and load_path is not None and not mismatched,
            "mismatched": mismatched,
        }
        (out / "resume.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    dist.barrier()
    if hasattr(engine, "destroy"):
        engine.destroy()

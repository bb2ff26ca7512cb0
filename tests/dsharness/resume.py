"""Resume from a saved checkpoint with real DeepSpeed, and check what was really loaded.

Run under torchrun (``resume_checkpoint`` below does that, and caches the result):

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 3 tests/dsharness/resume.py \\
        --spec '{"stage": 2}' --load SAVE_DIR --out DIR [--change '{"add_param": true}']

The job is built like a train.py job with ``--spec`` (same model, config and param groups;
``--change`` alters the model: ``add_param`` adds a Linear ``extra``, ``widen_l2`` gives ``l2``
two more outputs), then ``engine.load_checkpoint(SAVE_DIR)`` runs with DeepSpeed's defaults
(strict module load, optimizer states loaded). Rank 0 writes into DIR:

  manifest.json  the job's layout before loading (ckptspec.deepspeed.manifest_from_engine)
  resume.json    loaded: load_checkpoint returned a path and raised nothing
                 error: "ExceptionType: first line of the message", or null
                 consistent: every fp32 master of the job equals the saved run's live master
                   (SAVE_DIR/live_fp32.pt, written by train.py just before saving), for every
                   name saved; DeepSpeed can "load" and still leave wrong masters
                 mismatched: names whose masters are missing, reshaped or differ
"""
import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train import DIM, HIDDEN, build_model, ds_config, live_fp32, normalize_spec, param_groups  # noqa: E402
else:
    from .train import DIM, HIDDEN, build_model, ds_config, live_fp32, normalize_spec, param_groups

RESUME_SCRIPT = Path(__file__).resolve()
TRAIN_SCRIPT = RESUME_SCRIPT.with_name("train.py")
REPO_ROOT = RESUME_SCRIPT.parents[2]
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--load", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--change", default="{}")
    args = ap.parse_args()
    spec = normalize_spec(json.loads(args.spec))
    change = json.loads(args.change)
    unknown = set(change) - set(CHANGES)
    if unknown:
        raise ValueError(f"unknown change keys: {sorted(unknown)}")

    import torch
    import torch.distributed as dist
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if spec["dtype"] == "fp16":
        get_accelerator().is_fp16_supported = lambda: True  # as train.py does
    torch.manual_seed(spec["seed"])
    deepspeed.init_distributed()
    rank = dist.get_rank()
    model = _changed_model(spec, change)
    optimizer = torch.optim.AdamW(param_groups(model, spec), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(spec))

    from ckptspec.deepspeed import manifest_from_engine

    manifest = manifest_from_engine(engine).to_dict()
    error = None
    load_path = None
    try:
        load_path, _ = engine.load_checkpoint(str(args.load))
    except Exception as exc:  # the outcome under test: record it, do not crash
        error = _first_line(exc)

    live = live_fp32(engine, model, spec["stage"])  # collective: every rank
    saved = torch.load(args.load / "live_fp32.pt", map_location="cpu", weights_only=True)
    mismatched = sorted(n for n, t in saved.items()
                        if n not in live or live[n].shape != t.shape or not torch.equal(live[n], t.float()))
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
        result = {"loaded": error is None and load_path is not None, "error": error,
                  "consistent": error is None and load_path is not None and not mismatched, "mismatched": mismatched}
        (args.out / "resume.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- runner (pytest side)


def _saved_identity(save_dir: Path) -> dict:
    """What the saved checkpoint's DeepSpeed state depends on (train.py's hooks write only extra files)."""
    info = json.loads((save_dir / "harness.json").read_text())
    spec = dict(info["spec"], hook=None)
    return {"spec": spec, "world_size": info["world_size"], "deepspeed": info["deepspeed_version"],
            "train_py": hashlib.sha256(TRAIN_SCRIPT.read_bytes()).hexdigest()}


def resume_key(save_dir: Path, spec: dict, world_size: int, change: dict) -> str:
    blob = json.dumps({"saved": _saved_identity(save_dir), "spec": normalize_spec(spec), "world_size": world_size,
                       "change": change, "resume_py": hashlib.sha256(RESUME_SCRIPT.read_bytes()).hexdigest()},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _run(save_dir: Path, spec: dict, world_size: int, change: dict, out: Path) -> str:
    from .build import run_torchrun

    args = ["--spec", json.dumps(spec), "--load", str(save_dir), "--out", str(out), "--change", json.dumps(change)]
    return run_torchrun(RESUME_SCRIPT, args, world_size, out, what="resume run")


def resume_checkpoint(save_dir, spec: dict, world_size: int, root, change: dict | None = None) -> dict:
    """Run (or take from the cache under ``root``) one resume; returns resume.json plus ``manifest``."""
    save_dir, root, change = Path(save_dir), Path(root), dict(change or {})
    key = "resume-" + resume_key(save_dir, spec, world_size, change)
    final = root / key
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / "resume.json").exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
            try:
                log = _run(save_dir, spec, world_size, change, tmp / "out")
                (tmp / "out" / "resume.log").write_text(log)
                os.rename(tmp / "out", final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    result = json.loads((final / "resume.json").read_text())
    result["manifest_path"] = str(final / "manifest.json")
    return result


if __name__ == "__main__":
    main()

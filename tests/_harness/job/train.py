"""Task "train": train the tiny model a few steps with real DeepSpeed and save a checkpoint.

``args`` is the spec (model.DEFAULTS). Besides the DeepSpeed checkpoint, rank 0 writes into OUT:
  live_fp32.pt   name -> fp32 master weight, read from the live engine just before saving
                 (trainable params only, tied aliases included under every name)
  live_optim.pt  the optimizer state per trainable param (exp_avg, exp_avg_sq in the param's
                 shape), each optimizer group's step and hyperparameters, read from the live
                 engine's flat buffers just before saving (model.live_optimizer_state)
  harness.json   the normalized spec, world size, versions and optimizer class, and where
                 DeepSpeed's own getters (safe_get_full_fp32_param, safe_get_full_optimizer_state)
                 disagree with the live buffers (model.safe_get_mismatches, model.optimizer_state_getter)
and each hook of ``spec["hooks"]`` (hooks.py) writes what it records.
"""

import json
from pathlib import Path

from _harness.job import hooks
from _harness.job.model import (
    SEQ,
    VOCAB,
    build_model,
    ds_config,
    live_fp32,
    live_optimizer_state,
    normalize_spec,
    optimizer_state_getter,
    param_groups,
    safe_get_mismatches,
)


def train_engine(spec):
    """A fresh engine of ``spec`` after ``spec["steps"]`` training steps (the same on every launch)."""
    import deepspeed
    import torch
    import torch.distributed as dist

    torch.manual_seed(spec["seed"])
    model = build_model(spec)  # same seed on every rank -> identical initial weights
    optimizer = torch.optim.AdamW(param_groups(model, spec), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(spec))
    rank = dist.get_rank()
    for step in range(spec["steps"]):
        g = torch.Generator().manual_seed(spec["seed"] + 1000 * rank + step)  # per-rank data
        tokens = torch.randint(0, VOCAB, (spec["micro_batch"], SEQ), generator=g)
        targets = torch.randint(0, VOCAB, (spec["micro_batch"], SEQ), generator=g)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
    return engine, model


def run(args, out: Path):
    import deepspeed
    import torch
    import torch.distributed as dist

    spec = normalize_spec(args)
    engine, model = train_engine(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    live = live_fp32(engine, model, spec["stage"])
    mismatches = safe_get_mismatches(model, live, spec["stage"])
    live_optim = live_optimizer_state(engine, model, spec["stage"])
    optim_stale, optim_mismatches = optimizer_state_getter(engine, model, live_optim, spec["stage"])
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save(live, out / "live_fp32.pt")
        torch.save(live_optim, out / "live_optim.pt")
        info = {
            "spec": spec,
            "world_size": world,
            "deepspeed_version": deepspeed.__version__,
            "torch_version": torch.__version__,
            "optimizer_class": type(engine.optimizer).__name__,
            "tag": f"global_step{engine.global_steps}",
            "safe_get_full_fp32_param_mismatches": mismatches,
            "safe_get_full_optimizer_state_stale": optim_stale,
            "safe_get_full_optimizer_state_mismatches": optim_mismatches,
        }
        (out / "harness.json").write_text(json.dumps(info, indent=1, sort_keys=True))

    if spec["save_with"] == "ckptspec":
        from ckptspec.deepspeed import save_checkpoint

        saved = save_checkpoint(engine, str(out), exclude_frozen_parameters=spec["exclude_frozen"])
        (out / f"saved_manifest.rank{rank}.json").write_text(json.dumps(saved.to_dict(), sort_keys=True))
    elif spec["save"]:
        engine.save_checkpoint(str(out), exclude_frozen_parameters=spec["exclude_frozen"])

    for name in spec["hooks"]:
        getattr(hooks, name)(engine, out, spec)
    dist.barrier()
    if hasattr(engine, "destroy"):  # ZeRO-3 removes its module hooks
        engine.destroy()

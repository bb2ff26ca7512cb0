"""Reshard ground truth beyond job/resume.py (issue #15): a launch of its own for "reshard" tasks.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node N tests/_harness/reshard_job.py --tasks TASKS.json

A "reshard" task is a job/resume.py "resume" task with ``reshard`` (rank 0 runs ckptspec's reshard
on ``load`` into OUT/resharded, every rank loads that with ``engine.load_checkpoint``; frozen
parameters, buffers and ties checked after loading by job/model_checks.py, as resume.py does), plus
what resume.py does not do:

* before loading, the job's frozen parameters and buffers hold values no checkpoint holds (before_load.py): a
  frozen parameter or buffer the output lacks is not the source's by chance of the same seed;
* ``load_module_strict`` is false when the spec excludes frozen parameters: DeepSpeed saves none of
  them then, and its own strict module load refuses such a checkpoint (as it refuses DeepSpeed's);
* ``universal`` ("ckptspec" or "deepspeed"): instead of resharding, rank 0 converts ``load`` to
  DeepSpeed's universal folder (``ckptspec export-universal`` in-process, or DeepSpeed's own
  ``ds_to_universal --inject_missing_state``) into OUT/uc, and the job loads it with
  ``checkpoint.load_universal: true``; ``reshard_error`` holds the conversion's error;
* ``reshard`` with ``grad_accum_dtype`` (the target job's optimizer kind changed: BF16_Optimizer or ZeRO's), passed to
  the public ``ckptspec.reshard``;
* a stage-0 target job (``_stage0_checks``): DeepSpeed's getters answer None at stage 0 (no fragment mapping) and
  model.live_optimizer_state reads ZeRO's flat buffers, so the optimizer state is read from the stage-0 optimizer itself
  (``FP16_UnfusedOptimizer``: the wrapped torch optimizer's state of each ``fp32_groups`` master; fp32: the client
  optimizer's of each parameter): ``optim_mismatched`` / ``optim_consistent`` against the source's ``live_optim.pt``
  (every moment and each group's step), ``masters_held`` (the masters the optimizer holds: a tie's once);
  ``stage0_logits`` (the logits of a fixed batch, and those of a plain torch model holding the source's saved module:
  OUT/logits.pt) and, after the extra step, ``tied_after_step_mismatched`` (a tie no longer one parameter, or its
  weight not the stepped master in the model dtype).

resume.json and after_step.pt are resume.py's (same keys), plus the ones above.
"""

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make `_harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness.before_load import unlike_any_checkpoint
from _harness.job import resume
from _harness.job.main import serve
from _harness.job.model import build_model, ds_config, live_fp32, normalize_spec, param_groups
from _harness.job.model_checks import model_checks


def _universal(load: Path, out: Path, how: str, rank: int):
    """Rank 0 converts ``load`` to a universal folder OUT/uc/global_step2_universal; every rank learns the outcome."""
    import torch.distributed as dist

    base = out / "uc"
    outcome = [None]
    if rank == 0:
        base.mkdir(parents=True, exist_ok=True)
        target = base / "global_step2_universal"
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                if how == "deepspeed":
                    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

                    ds_to_universal(
                        argparse.Namespace(
                            input_folder=str(load / "global_step2"),
                            output_folder=str(target),
                            num_extract_workers=1,
                            num_merge_workers=1,
                            keep_temp_folder=False,
                            strict=True,
                            inject_missing_state=True,
                        )
                    )
                else:
                    from ckptspec.export.universal import export_universal

                    export_universal(load, target)
            (base / "latest_universal").write_text(target.name)
        except Exception as exc:  # recorded: a test asserts there is none
            outcome[0] = resume._first_line(exc)
        (out / "universal.log").write_text(log.getvalue())
    dist.broadcast_object_list(outcome, src=0)
    return outcome[0], base


def _reshard(load: Path, out: Path, reshard: dict, rank: int):
    """job/resume.py's ``_reshard``, through the public ``ckptspec.reshard`` with the target job's ``grad_accum_dtype``
    where the task gives one (``--grad-accum-dtype``: it picks the target's optimizer kind)."""
    if "grad_accum_dtype" not in reshard:
        return resume._reshard(load, out, reshard, rank)
    import torch.distributed as dist

    target, outcome = out / "resharded", [None]
    if rank == 0:
        from ckptspec import reshard as run_reshard

        out.mkdir(parents=True, exist_ok=True)
        try:
            run_reshard(
                load,
                target,
                reshard["world_size"],
                zero_stage=reshard.get("stage"),
                sub_group_size=reshard.get("sub_group_size"),
                grad_accum_dtype=reshard["grad_accum_dtype"],
            )
        except Exception as exc:  # recorded: a test asserts there is none
            outcome[0] = resume._first_line(exc)
    dist.broadcast_object_list(outcome, src=0)
    return outcome[0], target


def run(args, out: Path):
    import deepspeed
    import torch
    import torch.distributed as dist

    spec, load = normalize_spec(args["spec"]), Path(args["load"])
    torch.manual_seed(spec["seed"])
    rank = dist.get_rank()
    model = build_model(spec)
    optimizer = torch.optim.AdamW(param_groups(model, spec), lr=1e-2)
    config = ds_config(spec)
    if args.get("universal"):
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    # frozen parameters and buffers: only the load gives the source's back (the job's own frozen parameters kept where
    # nothing loaded holds them: excluded from the source, or a universal load, which reads no module)
    unlike_any_checkpoint(model, keep_frozen=spec["exclude_frozen"] or bool(args.get("universal")))

    if args.get("dcp"):  # an FSDP2 job's DCP save (dcp_save_job.py), resharded: what the engine then holds
        _dcp_load(engine, model, spec, load, out, args["reshard"], rank)
        return
    error = load_path = None
    if args.get("universal"):
        reshard_error, target = _universal(load, out, args["universal"], rank)
    else:
        reshard_error, target = _reshard(load, out, args["reshard"], rank)
    if reshard_error is None:
        try:
            load_path, _ = engine.load_checkpoint(str(target), load_module_strict=not spec["exclude_frozen"])
        except Exception as exc:  # the outcome under test: record it, do not crash
            error = resume._first_line(exc)
    live = live_fp32(engine, model, spec["stage"])  # collective: every rank
    saved = torch.load(load / "live_fp32.pt", map_location="cpu", weights_only=True)
    mismatched = sorted(
        n for n, t in saved.items() if n not in live or live[n].shape != t.shape or not torch.equal(live[n], t.float())
    )
    loaded = error is None and reshard_error is None and load_path is not None
    result = {"loaded": loaded, "error": error, "reshard_error": reshard_error, "mismatched": mismatched}
    result["consistent"] = loaded and not mismatched
    if loaded:
        worst = {n: (live[n] - t.float()).abs().max().item() for n, t in saved.items() if n in live}
        result["max_abs_diff"] = max(worst.values(), default=0.0)
        if spec["stage"] == 0:  # the stage-0 optimizer's own state (DeepSpeed's getters answer None)
            result.update(_stage0_checks(engine, model, load))
        else:
            result.update(resume._optimizer_checks(engine, model, spec["stage"], load, saved))
        result.update(model_checks(model, spec["stage"], load, saved))
    logits = _logits_against_source(model, spec, load) if loaded and spec["stage"] == 0 else None
    after = resume._extra_step(engine, model, spec, args["extra_step"]) if loaded and args.get("extra_step") else None
    if after is not None and spec["stage"] == 0:
        result["tied_after_step_mismatched"] = _ties_after_step(engine, model, after)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "resume.json").write_text(json.dumps(result, indent=1, sort_keys=True))
        if after is not None:
            torch.save(after, out / "after_step.pt")
        if logits is not None:
            torch.save(logits, out / "logits.pt")
    dist.barrier()
    if hasattr(engine, "destroy"):
        engine.destroy()


def _stage0_held(engine, model) -> list:
    """(parameter, the tensor keying its torch optimizer state, its group) for each parameter a stage-0 optimizer
    holds, in its order: FP16_UnfusedOptimizer's fp32 masters, or (fp32) the client optimizer's parameters."""
    opt = engine.optimizer
    if hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):  # FP16_UnfusedOptimizer (bf16, fp16)
        groups = zip(opt.fp16_groups, opt.fp32_groups)
        return [(p, m, g) for g, (lp, fp) in enumerate(groups) for p, m in zip(lp, fp)]
    inner = getattr(opt, "optimizer", opt)
    return [(p, p, g) for g, group in enumerate(inner.param_groups) for p in group["params"]]


def _stage0_checks(engine, model, source: Path) -> dict:
    """resume._optimizer_checks's keys for a stage-0 job: every moment and each group's step against the source's
    ``live_optim.pt``, by name (a tie's both names); ``masters_held``: the masters the optimizer holds, the distinct
    parameters they are of, and the module's trainable parameters (a tie once)."""
    import torch

    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    names: dict = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    held, state, steps = _stage0_held(engine, model), {}, {}
    for p, key, g in held:
        saved_state = inner.state[key]
        moments = {k: v.detach().clone().view(p.shape) for k, v in saved_state.items() if k != "step"}
        state.update({n: moments for n in names[id(p)]})
        steps.setdefault(g, set()).add(float(saved_state["step"]))
    saved = torch.load(source / "live_optim.pt", map_location="cpu", weights_only=True)
    bad = sorted(
        f"{n}.{k}"
        for n, states in saved["state"].items()
        for k, t in states.items()
        if n not in state or k not in state[n] or not torch.equal(state[n][k], t)
    )
    one_step = {g: s.pop() for g, s in steps.items() if len(s) == 1}
    if one_step != saved["steps"]:
        bad.append(f"steps {steps} != {saved['steps']}")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    scaler = getattr(opt, "loss_scale_config", None)
    return {
        "optim_mismatched": bad,
        "optim_consistent": not bad,
        "masters_held": [len(held), len({id(p) for p, _, _ in held}), len(trainable)],
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "loss_scale": float(scaler.cur_scale) if scaler is not None else None,
    }


def _logits(module, tokens):
    """The test model's logits (job/model.py's forward up to the head), without its buffer updates."""
    import torch

    with torch.no_grad():
        h = module.emb(tokens)
        if hasattr(module, "frozen"):
            h = h + module.frozen(h)
        return module.head(module.l2(torch.relu(module.l1(h)))).float()


def _logits_against_source(model, spec, source: Path) -> dict:
    """The logits of a fixed batch from the loaded job, and from a plain torch model of the same spec holding the
    source's saved module (its rank-0 model states, as DeepSpeed saved them)."""
    import torch

    from _harness.job.model import SEQ, VOCAB

    tag = (source / "latest").read_text().strip()
    saved = torch.load(source / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    dtype = next(p.dtype for p in model.parameters())
    plain = build_model(spec).to(dtype)
    plain.load_state_dict(saved["module"])
    g = torch.Generator().manual_seed(spec["seed"] + 7)
    tokens = torch.randint(0, VOCAB, (spec["micro_batch"], SEQ), generator=g)
    return {"job": _logits(model, tokens), "source": _logits(plain, tokens)}


def _ties_after_step(engine, model, after: dict) -> list:
    """After the extra step: the ties no longer one parameter (the alias another object, or held twice by the
    optimizer), or whose weight is not the stepped master cast to the model dtype."""
    import torch

    held = [id(p) for p, _, _ in _stage0_held(engine, model)]
    seen, bad = {}, []
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = seen.setdefault(id(p), name)
        if owner == name:
            continue
        alias = model.get_parameter(name)
        if alias is not model.get_parameter(owner) or held.count(id(p)) != 1 or name not in after:
            bad.append(name)
        elif not torch.equal(alias.detach(), after[owner].to(alias.dtype)):
            bad.append(name)
    return sorted(bad)


def _dcp_load(engine, model, spec, load: Path, out: Path, reshard: dict, rank: int) -> None:
    """Rank 0 reshards LOAD/dcp (an FSDP2 job's save, dcp_save_job.py) into OUT/resharded; every rank loads it and
    rank 0 writes OUT/dcp_load.pt (the test compares it with LOAD/oracle.pt): ``master`` and ``state`` (exp_avg,
    exp_avg_sq) of every trainable parameter from DeepSpeed's getters, ``weights`` (the module's trainable parameters:
    the job's model dtype), ``step`` and ``hyperparameters`` per param group of the wrapped torch optimizer,
    ``module`` (every frozen parameter and buffer as loaded), ``params2`` (the
    fp32 masters after one more step on the batch the FSDP2 job's second step took, each rank the same one, as
    every FSDP2 rank took it: the same mean gradient), and ``error`` / ``reshard_error`` (then nothing else)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from _harness.dcp_save_job import BATCH_SEED
    from _harness.job.model import SEQ, VOCAB

    target, outcome = out / "resharded", [None]
    if rank == 0:  # the public API (job/resume.py's _reshard calls the ZeRO one)
        from ckptspec import reshard as run_reshard

        out.mkdir(parents=True, exist_ok=True)
        try:
            dtype = {"fp32": "float32", "bf16": "bfloat16"}[reshard.get("model_dtype", "fp32")]
            run_reshard(load / "dcp", target, reshard["world_size"], zero_stage=reshard["stage"], model_dtype=dtype)
        except Exception as exc:  # recorded: the test asserts there is none
            outcome[0] = resume._first_line(exc)
    dist.broadcast_object_list(outcome, src=0)
    reshard_error = outcome[0]
    record: dict = {"reshard_error": reshard_error, "error": None}
    if reshard_error is None:
        try:
            engine.load_checkpoint(str(target))
        except Exception as exc:  # the outcome under test: record it, do not crash
            record["error"] = resume._first_line(exc)
    if record["reshard_error"] is None and record["error"] is None:
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        opt = engine.optimizer
        if hasattr(opt, "_hp_optimizer_states_linked"):  # as resume.py: the getters' mapping of the loaded state
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()
        record["master"] = {n: safe_get_full_fp32_param(p).clone() for n, p in trainable}
        record["state"] = {
            n: {k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")} for n, p in trainable
        }
        inner = engine.optimizer.optimizer  # the wrapped torch AdamW: one flat master per group (ZeRO-3: sub-group)
        if spec["stage"] == 3:  # its param groups list no flat (DeepSpeed steps them one sub-group at a time)
            firsts: dict = {}  # param group -> its first sub-group's flat master
            for j, flat in enumerate(opt.fp32_partitioned_groups_flat):
                firsts.setdefault(int(opt.sub_group_to_group_id[j]), flat)
            record["step"] = [float(inner.state[firsts[g]]["step"]) for g in range(len(inner.param_groups))]
        else:
            record["step"] = [float(inner.state[g["params"][0]]["step"]) for g in inner.param_groups]
        record["hyperparameters"] = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        params = list(model.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=spec["stage"] == 3):
            frozen = {n: p.detach().clone() for n, p in params if not p.requires_grad}
            record["weights"] = {n: p.detach().clone() for n, p in params if p.requires_grad}  # the job's dtype
        saved = model.state_dict()  # the persistent buffers
        record["module"] = {**frozen, **{n: b.detach().clone() for n, b in model.named_buffers() if n in saved}}
        g = torch.Generator().manual_seed(BATCH_SEED + 2)  # dcp_save_job.py's second step, on every rank
        tokens = torch.randint(0, VOCAB, (spec["micro_batch"], SEQ), generator=g)
        targets = torch.randint(0, VOCAB, (spec["micro_batch"], SEQ), generator=g)
        engine.backward(engine(tokens, targets))
        engine.step()
        record["params2"] = {n: safe_get_full_fp32_param(p).clone() for n, p in trainable}
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(record, out / "dcp_load.pt")
    dist.barrier()
    if hasattr(engine, "destroy"):
        engine.destroy()


def main():
    serve(lambda task: run(task["args"], Path(task["out"])))


if __name__ == "__main__":
    main()

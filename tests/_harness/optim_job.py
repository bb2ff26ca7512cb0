"""The optimizer state of a MoE, ZeRO stage-0 or stage-0 pipeline checkpoint as DeepSpeed reads it
(issue #39): a launch of its own for "optim" tasks.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node N tests/_harness/optim_job.py --tasks TASKS.json

A task (``{"kind": "optim", "args": {"spec", "source", "load"}, "out"}``) names a "parallel" entry
(``load``) and the spec it was trained with (job/parallel_models.py). Every rank builds the same
engine (job/parallel.py's, no training step), fills its frozen parameters and buffers with values no checkpoint
holds (before_load.py), loads the checkpoint with ``engine.load_checkpoint``
(DeepSpeed's defaults: the optimizer states loaded) and records, per trainable parameter of its own,
the optimizer state the live engine then holds. Every rank writes ``OUT/optim.rank<R>.pt``:

  state         global name (job/parallel.py's ``_names``: experts under their global id) ->
                {"exp_avg", "exp_avg_sq"}: full tensors in the parameter's shape, fp32
  step          global name -> the torch optimizer's ``step`` of the parameter's state
  param_groups  the wrapped torch optimizer's param groups, without ``params``
  group         global name -> the index of the torch param group the parameter is in
  source        global name -> where the value came from: ``safe_get_full_optimizer_state``
                (ZeRO 1/2, BF16_Optimizer: every parameter with an ``_hp_mapping``; ZeRO-3: gathered), else the wrapped
                torch optimizer's state of the parameter's fp32 master (FP16_UnfusedOptimizer), of its
                group's flat master cut the way FP16_Optimizer copies masters back
                (``_unflatten_dense_tensors``), or of the parameter itself (stage 0 fp32: no masters)
  getter        global name -> whether ``safe_get_full_optimizer_state`` answered at all (it returns
                None at stage 0 outside BF16_Optimizer: there is no fragment mapping)

  master        global name -> the fp32 master ``safe_get_full_fp32_param`` gives (where it answers)
  loss_scaler   the wrapper's loss scaler as loaded, its numbers: ``cur_scale`` and the dynamic scaler's counters
                (``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``...; ZeRO's ``loss_scaler``, a stage-0
                fp16/bf16 wrapper's ``loss_scale_config``), None where there is none
  coords        this rank's coordinates (job/parallel.py ``_coords``: pp, tp, dp, ...)
  module        local name -> every frozen parameter and buffer of the module's state dict, as loaded
  logits        the logits of a fixed batch, fp32: a dense, AutoTP or MoE model's (``LOGITS_SEED``, eval mode); a
                pipeline's: the last stage's output (job/parallel.py ``_logits``), None on other stages

After recording, every task takes one more training step on the same global batch whatever the layout
(``_one_more_step``) and records the same keys again as ``OUT/step.rank<R>.pt``: a "+optim" entry (the source
resumed at its own layout) gives what a job that never stopped holds after that step, a reshard task what the
target layout holds after it.

A task with ``universal`` also loads, into a second engine of the same spec with ``checkpoint.load_universal``,
the folder DeepSpeed's ``ds_to_universal`` wrote beside ``load`` (``latest_universal``): DeepSpeed's own path to
the task's layout, recorded as ``OUT/universal.rank<R>.pt`` (``universal_error`` in optim.json when it fails).

A task with ``reshard`` (issue #40) loads not ``load`` but what rank 0 wrote with ``ckptspec.reshard(load,
OUT/resharded, world_size=<this job's>, zero_stage=..., <the task's other options: tensor_parallel...>)``
(with ``export_universal``: ``ckptspec.export_universal(load, OUT/resharded/universal)``, loaded by a job with
``checkpoint.load_universal: true``)
(``reshard_error`` in optim.json when it refused: then nothing is loaded): the masters and optimizer state a job
of the target layout (the task's ``spec``) holds after resuming from it.

and rank 0 ``OUT/optim.json``: ``load``, ``loaded`` (the model-states file DeepSpeed read) and
``load_checkpoint_error``: where ``load_checkpoint`` itself cannot load the optimizer state (a stage-0
bf16 pipeline, see ``run``), its error; the state is then read by DeepSpeed's ZeRO-file loader.

The checkpoint's saving job did not record its optimizer state (job/parallel.py records masters only),
and changing it would re-key every job; loading is DeepSpeed's own reading of the same files.
"""

import gc
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make `_harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness.before_load import unlike_any_checkpoint
from _harness.job import parallel
from _harness.job.main import reset_deepspeed_globals, serve
from _harness.job.parallel_models import BATCH, batch, build_model, ds_config, layout, normalize, torch_dtype

KEYS = ("exp_avg", "exp_avg_sq")
LOGITS_SEED = 4040  # the fixed batch whose logits are recorded
STEP_SEED = 5050  # the global batch of the one more step every task takes after loading
STEP_SAMPLES = 24  # its samples: an equal share for 1, 2, 3 or 4 data ranks, two micro batches each for a pipeline


def _by_master(opt):
    """id(lp param) -> (inner state key tensor, a function of a state tensor giving the param's slice, group)."""
    from torch._utils import _unflatten_dense_tensors

    out = {}
    if hasattr(opt, "fp32_groups_flat") and hasattr(opt, "fp16_groups"):  # FP16_Optimizer
        for g, (flat, lp_group) in enumerate(zip(opt.fp32_groups_flat, opt.fp16_groups)):
            for i, p in enumerate(lp_group):
                out[id(p)] = (flat, lambda t, lp=lp_group, i=i: _unflatten_dense_tensors(t, lp)[i], g)
        return out, "FP16_Optimizer.fp32_groups_flat"
    if hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):  # FP16_UnfusedOptimizer
        for g, (lp_group, fp_group) in enumerate(zip(opt.fp16_groups, opt.fp32_groups)):
            for p, m in zip(lp_group, fp_group):
                out[id(p)] = (m, lambda t: t, g)
        return out, "FP16_UnfusedOptimizer.fp32_groups"
    for g, group in enumerate(opt.param_groups):  # the client optimizer itself: the params are the masters
        for p in group["params"]:
            out[id(p)] = (p, lambda t: t, g)
    return out, "module (fp32, no masters)"


def _flat_groups(opt) -> dict:
    """id(lp param) -> (its torch param group, the fp32 partition keying its optimizer state)."""
    if hasattr(opt, "bit16_groups"):  # DeepSpeedZeroOptimizer
        groups, parts = opt.bit16_groups, opt.single_partition_of_fp32_groups
    elif hasattr(opt, "bf16_groups"):  # BF16_Optimizer
        groups, parts = opt.bf16_groups, opt.fp32_groups_flat_partition
    elif hasattr(opt, "fp32_partitioned_groups_flat"):  # DeepSpeedZeroOptimizer_Stage3: per sub-group
        groups, parts, group_of = opt.fp16_groups, opt.fp32_partitioned_groups_flat, opt.sub_group_to_group_id
        return {id(p): (group_of[s], parts[s]) for s, group in enumerate(groups) for p in group}
    else:
        return {}
    return {id(p): (g, parts[g]) for g, group in enumerate(groups) for p in group}


def run(args, out: Path):
    import torch
    import torch.distributed as dist

    spec = normalize({**args["spec"], "steps": 0, "save": False, "universal": False})
    load, reshard_error = args["load"], None
    if args.get("reshard"):
        load, reshard_error = _resharded(load, out, args["reshard"], spec)
        if reshard_error is not None:
            if dist.get_rank() == 0:
                (out / "optim.json").write_text(json.dumps({"load": args["load"], "reshard_error": reshard_error}))
            return
    # ckptspec's universal folder of the source (export-universal) is loaded as DeepSpeed loads its own
    universal = args.get("reshard", {}).get("export_universal")
    engine = _universal_engine(spec) if universal else parallel._train(spec)[0]
    # frozen parameters and buffers: only the load gives the source's back (load_universal reads no module: the
    # job's own frozen parameters are kept, before_load.py)
    unlike_any_checkpoint(engine.module, keep_frozen=bool(universal))
    load_error = None
    try:
        load_path, _ = engine.load_checkpoint(load)
    except KeyError as exc:
        # A stage-0 bf16 pipeline (BF16_Optimizer): load_checkpoint hands the optimizer the model states'
        # copy of rank 0's state (a dict) where BF16_Optimizer.load_state_dict takes every rank's list
        # (KeyError: 0). DeepSpeed's own reader of the files it wrote for it, bf16_zero_pp_rank_*, is the
        # ZeRO one: the module and counters through load_checkpoint, the optimizer state through it. A PipelineModule
        # at one stage (``pipe``) runs BF16_Optimizer too.
        if not (layout(spec) == "pipe" and spec["stage"] == 0 and spec["dtype"] == "bf16"):
            raise
        load_error = f"{type(exc).__name__}: {exc}"
        load_path, _ = engine.load_checkpoint(load, load_optimizer_states=False)
        tag = (Path(load) / "latest").read_text().strip()
        assert engine._load_zero_checkpoint(load, tag, load_optimizer_states=True)
    assert load_path is not None, f"DeepSpeed loaded nothing from {load}"
    rank = dist.get_rank()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(_record(engine, spec), out / f"optim.rank{rank}.pt")
    _one_more_step(engine, spec)
    torch.save(_record(engine, spec), out / f"step.rank{rank}.pt")
    universal_error = None
    if args.get("universal"):  # DeepSpeed's own path to the target layout: its universal folder of the source
        dist.barrier()
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine
        gc.collect()
        reset_deepspeed_globals()
        engine = _universal_engine(spec)
        unlike_any_checkpoint(engine.module, keep_frozen=True)
        try:
            assert engine.load_checkpoint(args["load"])[0] is not None, f"DeepSpeed loaded nothing from {args['load']}"
            torch.save(_record(engine, spec), out / f"universal.rank{rank}.pt")
        except Exception as exc:  # recorded: the tests say what DeepSpeed's path does
            universal_error = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        outcome = {"load": args["load"], "loaded": str(load_path), "load_checkpoint_error": load_error}
        if args.get("universal"):
            outcome["universal_error"] = universal_error
        (out / "optim.json").write_text(json.dumps(outcome, indent=1))
    dist.barrier()
    if hasattr(engine, "destroy"):
        engine.destroy()


def _one_more_step(engine, spec) -> None:
    """One training step on the same global batch whatever the layout (``STEP_SEED``, ``STEP_SAMPLES`` samples):
    data-parallel rank d of D takes the d-th of D equal shares (every tensor rank of an AutoTP group the same, a
    pipeline in two micro batches, a MoE job's ranks each its own), as the source job resumed at its own layout
    does in its "+optim" entry: what a job that never stopped would do next, at either layout."""
    import torch

    micro = [batch(spec, STEP_SEED + i) for i in range(STEP_SAMPLES // BATCH)]
    x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
    per_sample = len(y) // STEP_SAMPLES  # a MoE sample has MOE_TOKENS targets
    share = STEP_SAMPLES // engine.dp_world_size
    first = parallel._dp_rank(engine) * share
    x, y = x[first : first + share].to(torch_dtype(spec)), y[first * per_sample : (first + share) * per_sample]
    engine.module.train()
    if layout(spec) == "pipe":  # stages pass activations of another batch size than the logits' batch: resized
        half = share // 2
        engine.reset_activation_shape()
        engine.train_batch(data_iter=iter([(x[:half], y[:half]), (x[half:], y[half:])]))
        engine.reset_activation_shape()
        return
    out = engine(x)
    if layout(spec) == "moe":
        out, l_aux = out
        loss = torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y) + 0.01 * l_aux
    else:
        loss = torch.nn.functional.cross_entropy(out.float(), y)
    engine.backward(loss)
    engine.step()


def _record(engine, spec) -> dict:
    """What the live engine holds (the module docstring's keys), every rank's collectives called in order."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    names = parallel._names(engine, spec)
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    if hasattr(opt, "_hp_optimizer_states_linked"):  # as after load_checkpoint: links to the loaded state
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    by_master, fallback = _by_master(opt)
    flat = _flat_groups(opt)  # ZeRO 1/2/3, BF16_Optimizer: id(lp param) -> (group, its fp32 partition)
    record = {"state": {}, "step": {}, "group": {}, "source": {}, "getter": {}, "master": {}}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        global_name = names[name]["global_name"]
        master = safe_get_full_fp32_param(p)  # collective where it answers
        if master is not None:
            record["master"][global_name] = master.detach().clone().float().reshape(p.shape)
        answers = {k: safe_get_full_optimizer_state(p, k) for k in KEYS}  # collective where it answers
        record["getter"][global_name] = all(a is not None for a in answers.values())
        if record["getter"][global_name]:
            state = {k: a.detach().clone().float().reshape(p.shape) for k, a in answers.items()}
            g, part = flat[id(p)]
            record["source"][global_name] = "safe_get_full_optimizer_state"
        else:
            part, cut, g = by_master[id(p)]
            state = {k: cut(inner.state[part][k]).detach().clone().reshape(p.shape) for k in KEYS}
            record["source"][global_name] = fallback
        record["state"][global_name] = state
        record["step"][global_name] = float(inner.state[part]["step"])
        record["group"][global_name] = g
    record["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    record["loss_scaler"] = _loss_scaler(opt)
    record["coords"] = parallel._coords(engine, spec)  # pipeline stage, tensor and data rank (job/parallel.py)
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    record["module"] = {  # frozen parameters and buffers as loaded (local names; an AutoTP shard where split)
        n: t.detach().clone() for n, t in engine.module.state_dict().items() if n not in trainable
    }
    if layout(spec) == "pipe":  # collective: the last stage's output on the fixed batch, None elsewhere
        record["logits"] = parallel._logits(engine, spec)[1]
    else:  # the logits of a fixed batch (every tensor rank takes part; a MoE layer's all-to-all every rank)
        x = batch(spec, LOGITS_SEED)[0].to(torch_dtype(spec))
        engine.module.eval()
        with torch.no_grad():
            out = engine.module(x)
        record["logits"] = (out[0] if isinstance(out, tuple) else out).detach().float().clone()  # MoE: (logits, l_aux)
    return record


def _loss_scaler(opt) -> dict | None:
    """The numbers of the loss scaler ``opt`` holds: ZeRO-1/2's ``loss_scaler`` object, or a stage-0 wrapper's
    ``loss_scale_config`` (FP16_UnfusedOptimizer's scale and counters)."""
    scaler = getattr(opt, "loss_scaler", None) or getattr(opt, "loss_scale_config", None)
    held = vars(scaler) if scaler is not None else {}
    return {k: v for k, v in held.items() if isinstance(v, bool | int | float)} or None


def _universal_engine(spec):
    """The engine of ``spec`` (job/parallel.py's model, optimizer and config) loading universal folders."""
    import deepspeed
    import torch

    torch.manual_seed(spec["seed"])
    model = build_model(spec)
    if spec["ep"]:  # a MoE's experts in their own param groups, as job/parallel.py's
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        params = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "params"}
        )
    else:
        params = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    config = {**ds_config(spec), "checkpoint": {"load_universal": True}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _resharded(load: str, out: Path, how: dict, spec: dict) -> tuple[str, str | None]:
    """Rank 0 writes ``load`` for this job's world size with ckptspec's reshard into OUT/resharded; every
    rank learns the outcome: (the path to load, the refusal or None)."""
    import torch.distributed as dist

    target = out / "resharded"
    outcome = [None]
    if dist.get_rank() == 0:
        import ckptspec

        out.mkdir(parents=True, exist_ok=True)
        try:
            if how.get("export_universal"):  # the folder, and the file naming it, as load_universal reads them
                target.mkdir()
                ckptspec.export_universal(load, target / "universal")
                (target / "latest_universal").write_text("universal")
            else:
                options = {k: v for k, v in how.items() if k not in ("world_size", "stage")}  # degrees (#40)
                if options.get("ds_config") == "target":  # the AutoTP rules of this job's own ds_config
                    options["ds_config"] = ds_config(spec)
                ckptspec.reshard(load, target, dist.get_world_size(), zero_stage=how.get("stage"), **options)
        except ckptspec.CkptspecError as exc:
            outcome = [f"{exc.code}: {exc.message}"]
    dist.broadcast_object_list(outcome, src=0)
    return str(target), outcome[0]


def main():
    serve(lambda task: run(task["args"], Path(task["out"])))


if __name__ == "__main__":
    main()

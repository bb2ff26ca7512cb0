"""Task "parallel": train a pipeline, AutoTP, MoE or dense ZeRO-0 job with real DeepSpeed, save it,
and record DeepSpeed's own answers about it (the ground truth of model-parallel checkpoints).

``args`` is a spec of parallel_models.DEFAULTS. Besides the DeepSpeed checkpoint, OUT holds:

  parallel.json      (rank 0) the normalized spec, world size, versions, optimizer class, tag;
                     ``ranks``: every rank's coordinates as DeepSpeed reports them (pipeline stage,
                     tp rank, dp rank, expert-parallel and expert-data-parallel ranks and groups,
                     ``checkpoint_mp_rank``: the mp rank of the files it writes);
                     ``global_shapes``: each parameter's shape in the whole model (tp1/pp1/ep1),
                     read from the model before DeepSpeed sharded it (AutoTP) or from the whole
                     model built with the same code (reference_model);
                     ``universal``: the outcome of ds_to_universal (when asked)
  oracle.rank<R>.pt  (every rank) ``masters``: local parameter name -> its full fp32 master as the
                     live engine gives it: ``safe_get_full_fp32_param`` (ZeRO 1-3, BF16_Optimizer),
                     else FP16_Optimizer's fp32 flat groups unflattened the way it copies them back
                     or FP16_UnfusedOptimizer's per-parameter fp32 masters (stage 0 bf16/fp16), else the
                     parameter itself (stage 0 fp32: no masters);
                     ``master_source`` per name; ``params``: local name -> global name (its name at
                     tp1/pp1/ep1: experts under the global index DeepSpeed saves them with), local
                     shape, pipeline layer, global expert id; ``module``: the module's parameters as
                     the forward used them; ``buffers``: the module's buffers as saved;
                     ``logits``: this rank's output on the fixed batch (None on a pipeline stage
                     that is not the last)
  eval.pt            (rank 0) the fixed batch: ``inputs`` (fp32; the job casts them to its dtype)
  oracle ``whole_masters``, ``whole_module``, ``whole_moments`` (a tensor-parallel pipeline, every rank) its
                     masters, module parameters and Adam moments whole: gathered over the tensor group along
                     each one's split dim (job/tp_layers.py)
  consolidated.pt    (rank 0, AutoTP) ``engine._consolidated_16bit_state_dict()``: DeepSpeed's own
                     merge of the tensor-parallel module weights (the training dtype)
  universal.log      (rank 0, when asked) ds_to_universal's output
  engine_index.rank<R>.json, saved_index.rank<R>.json  (every rank, ``save_with: ckptspec``) the live
                     engine's checkpoint index without files (ckptspec.deepspeed.live.model_parallel), and
                     the complete one the save hook (ckptspec.deepspeed.save_checkpoint) returned (a
                     tensor-parallel pipeline's given the split rules DeepSpeed's own save of it is given)

Nothing here re-derives what a reader of the files would compute: every tensor is read from the
live engine through DeepSpeed's API, and every name mapping is DeepSpeed's own (the pipeline's
``<layer>.<name>``, AutoTP's unchanged names, ``expp_rank * num_local_experts + local_id``
exactly as ``engine._save_moe_checkpoint`` renames experts).
"""

import argparse
import contextlib
import json
import shutil
from pathlib import Path

from _harness.job.parallel_models import (
    EVAL_SEED,
    batch,
    build_model,
    ds_config,
    layout,
    normalize,
    reference_model,
    torch_dtype,
)
from _harness.job.tp_layers import gather_whole, universal_info, whole_moments

EXPERTS_PREFIX = "deepspeed_experts."


def _train(spec):
    import deepspeed
    import torch
    import torch.distributed as dist

    torch.manual_seed(spec["seed"])
    model = build_model(spec)  # same seed on every rank -> identical initial weights
    global_shapes = {n: list(p.shape) for n, p in model.named_parameters()} if layout(spec) == "autotp" else None
    if spec["ep"]:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        params = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "params"}
        )
    else:
        params = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    # A client torch.optim.Adam: DeepSpeed's own "Adam" is FusedAdam, a C++ op JIT-compiled on
    # first use (minutes and gigabytes on this machine).
    optimizer = (_fused_adam_class() if spec["optimizer"] == "fused" else torch.optim.Adam)(params, lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(spec))
    dt = torch_dtype(spec)
    kind = layout(spec)
    rank = dist.get_rank()
    if kind == "pipe":

        def data(step):
            for micro in range(engine.micro_batches):
                x, y = batch(spec, spec["seed"] + 1000 * _dp_rank(engine) + 10 * step + micro)
                yield x.to(dt), y

        for step in range(spec["steps"]):
            engine.train_batch(data_iter=data(step))
    else:
        # Data seeded by the data-parallel rank: AutoTP requires the same batch in a tp group.
        data_rank = _dp_rank(engine) if kind == "autotp" else rank
        for step in range(spec["steps"]):
            x, y = batch(spec, spec["seed"] + 1000 * data_rank + step)
            out = engine(x.to(dt))
            if kind == "moe":
                out, l_aux = out
                loss = torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y) + 0.01 * l_aux
            else:
                loss = torch.nn.functional.cross_entropy(out.float(), y)
            engine.backward(loss)
            engine.step()
    return engine, global_shapes


def _fused_adam_class():
    """A FusedAdam that steps as torch's Adam. DeepSpeed wraps a stage-0 bf16/fp16 model's optimizer in
    its fused ``FP16_Optimizer`` (flat fp32 master groups) exactly when the client optimizer is a
    FusedAdam (``engine._configure_fp16_optimizer``: ``isinstance``), else in FP16_UnfusedOptimizer.
    FusedAdam's own step is a C++ op JIT-compiled on first use (minutes and gigabytes here); this one
    never builds it. What the checkpoint holds is FP16_Optimizer's (the masters, the loss scaler);
    only the inner optimizer's state dict is torch's Adam's."""
    import torch
    from deepspeed.ops.adam import FusedAdam

    class TorchStepFusedAdam(FusedAdam, torch.optim.Adam):
        def __init__(self, params, lr):
            torch.optim.Adam.__init__(self, params, lr=lr)  # not FusedAdam's: it loads the op

        step = torch.optim.Adam.step
        zero_grad = torch.optim.Optimizer.zero_grad

    return TorchStepFusedAdam


def _dp_rank(engine):
    if getattr(engine, "grid", None) is not None:
        return engine.grid.get_data_parallel_rank()
    if engine.mpu is not None:
        return engine.mpu.get_data_parallel_rank()
    import torch.distributed as dist

    return dist.get_rank()


def _coords(engine, spec):
    import torch.distributed as dist
    from deepspeed.utils import groups

    kind = layout(spec)
    out = {
        "rank": dist.get_rank(),
        "checkpoint_mp_rank": engine.checkpoint_mp_rank,
        "dp_world_size": engine.dp_world_size,
        "mp_world_size": engine.mp_world_size,
    }
    if kind == "pipe":
        grid = engine.grid
        out.update(
            pp=grid.get_pipe_parallel_rank(),
            tp=grid.get_slice_parallel_rank(),
            dp=grid.get_data_parallel_rank(),
            stage_layers=[engine.module._local_start, engine.module._local_stop],
        )
    elif kind == "autotp":
        out.update(
            pp=0,
            tp=groups.get_tensor_model_parallel_rank(),
            dp=engine.mpu.get_data_parallel_rank(),
        )
    else:
        out.update(pp=0, tp=0, dp=dist.get_rank())
    if kind == "moe":
        name = f"ep_size_{spec['ep']}"
        out.update(
            ep=groups._get_expert_parallel_rank(name),
            edp=groups._get_expert_data_parallel_rank(name),
            ep_group=sorted(groups._get_expert_parallel_group_ranks(name)),
            edp_group=sorted(groups._get_expert_data_parallel_group_ranks(name)),
        )
    return out


def _names(engine, spec):
    """Local parameter name -> (global name, pipeline layer, global expert id), DeepSpeed's mapping."""
    from deepspeed.utils import groups

    kind = layout(spec)
    out = {}
    for name, _ in engine.module.named_parameters():
        expert, global_name = None, name
        if kind == "pipe" and name.startswith("tied_modules."):
            # A TiedLayerSpec's module (one per stage that runs it): named in the whole model after the
            # first layer of its key (the others are ties of it), as PipelineModule lists the specs.
            from deepspeed.pipe import TiedLayerSpec

            _, key, attr = name.split(".", 2)
            specs = engine.module._layer_specs
            layer = next(i for i, s in enumerate(specs) if isinstance(s, TiedLayerSpec) and s.key == key)
            global_name = f"{layer}.{attr}"
        else:
            layer = int(name.split(".")[0]) if kind == "pipe" else None
        if kind == "moe" and EXPERTS_PREFIX in name:
            head, rest = name.split(EXPERTS_PREFIX)
            local_id, tail = rest.split(".", 1)
            moe_layer = engine.module.get_submodule(head.split(".deepspeed_moe.")[0])  # moe, moe2
            ep_rank = groups._get_expert_parallel_rank(moe_layer.expert_group_name)
            # engine._save_moe_checkpoint: global_expert_id = expp_rank * num_local_experts + local_expert_id
            expert = ep_rank * moe_layer.num_local_experts + int(local_id)
            global_name = f"{head}{EXPERTS_PREFIX}{expert}.{tail}"
        out[name] = {"global_name": global_name, "layer": layer, "expert": expert}
    return out


def _masters(engine, spec):
    """Local name -> (full fp32 master, where it came from); collective (call on every rank)."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    opt = engine.optimizer
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    masters, sources = {}, {}
    for name, p in named:  # collective within the parameter's data-parallel group: same order everywhere
        value = safe_get_full_fp32_param(p)
        if value is not None:
            masters[name], sources[name] = value.detach().clone().float(), "safe_get_full_fp32_param"
    missing = [(n, p) for n, p in named if n not in masters]
    if missing and hasattr(opt, "fp32_groups_flat") and hasattr(opt, "fp16_groups"):
        # FP16_Optimizer (stage 0 fp16/bf16): its step copies the masters back with this unflatten.
        from torch._utils import _unflatten_dense_tensors

        by_id = {}
        for flat, lp_group in zip(opt.fp32_groups_flat, opt.fp16_groups):
            for p, m in zip(lp_group, _unflatten_dense_tensors(flat, lp_group)):
                by_id[id(p)] = m
        for name, p in missing:
            masters[name], sources[name] = by_id[id(p)].detach().clone(), "FP16_Optimizer.fp32_groups_flat"
    elif missing and hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):
        # FP16_UnfusedOptimizer (stage 0 fp16/bf16 with a client optimizer): one fp32 master per
        # parameter, copied back pairwise by its step.
        by_id = {id(p): m for lp, fp in zip(opt.fp16_groups, opt.fp32_groups) for p, m in zip(lp, fp)}
        for name, p in missing:
            masters[name], sources[name] = by_id[id(p)].detach().clone(), "FP16_UnfusedOptimizer.fp32_groups"
    elif missing:
        for name, p in missing:  # no mixed precision: the parameters are the masters
            assert p.dtype == torch.float32 and spec["stage"] == 0, (name, p.dtype, type(opt).__name__)
            masters[name], sources[name] = p.detach().clone(), "module (fp32, no masters)"
    return masters, sources


def _logits(engine, spec):
    import torch

    x, y = batch(spec, EVAL_SEED)
    dt = torch_dtype(spec)
    kind = layout(spec)
    if kind == "pipe":
        _, outputs = engine.eval_batch(iter([(x.to(dt), y)]), return_logits=True, num_micro_batches=1)
        return x, (outputs.detach().clone() if engine.is_last_stage() else None)
    engine.eval()
    with torch.no_grad():
        out = engine(x.to(dt))
    if kind == "moe":
        out = out[0]
    engine.train()
    return x, out.detach().clone()


def _convert_universal(out: Path, tag: str, spec) -> dict:
    """DeepSpeed's ds_to_universal on the saved tag (rank 0, in this process, no worker pools)."""
    import io
    import traceback

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    target = out / f"{tag}_universal"
    args = argparse.Namespace(
        input_folder=str(out / tag),
        output_folder=str(target),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=spec["inject_missing_state"],
    )
    log = io.StringIO()
    result = {"output_folder": target.name, "inject_missing_state": spec["inject_missing_state"]}
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal(args)
        result.update(ok=True, error=None)
    except Exception as exc:  # the outcome under test: record it, and leave no partial folder
        first = (str(exc).strip().splitlines() or [""])[0]
        result.update(ok=False, error=f"{type(exc).__name__}: {first}"[:500])
        log.write(traceback.format_exc())
        shutil.rmtree(target, ignore_errors=True)
        (out / "latest_universal").unlink(missing_ok=True)
    (out / "universal.log").write_text(log.getvalue())
    return result


def _save_with_ckptspec(engine, out: Path, rank: int, client_state):
    """The save hook (ckptspec.deepspeed.save_checkpoint), and the live engine's index without files
    (``engine_index.rank<R>.json``, every rank: they must agree), both as every rank returns them;
    ``client_state`` as DeepSpeed's own save of the job is given it."""
    from ckptspec.deepspeed import save_checkpoint
    from ckptspec.deepspeed.live import index_from_engine

    live = index_from_engine(engine, client_state=client_state).to_dict()
    saved = save_checkpoint(engine, str(out), client_state=client_state).to_dict()
    (out / f"engine_index.rank{rank}.json").write_text(json.dumps(live, sort_keys=True))
    (out / f"saved_index.rank{rank}.json").write_text(json.dumps(saved, sort_keys=True))


def run(args, out: Path):
    import deepspeed
    import torch
    import torch.distributed as dist

    spec = normalize(args)
    kind = layout(spec)
    engine, global_shapes = _train(spec)
    rank = dist.get_rank()
    masters, sources = _masters(engine, spec)
    names = _names(engine, spec)
    x, logits = _logits(engine, spec)
    consolidated = engine._consolidated_16bit_state_dict() if spec["tp"] > 1 and layout(spec) == "autotp" else None
    coords = _coords(engine, spec)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, coords)

    out.mkdir(parents=True, exist_ok=True)
    params = {  # ZeRO-3 leaves empty placeholders: the local shape is ds_shape
        n: {
            **names[n],
            "local_shape": list(getattr(p, "ds_shape", p.shape)),
            "dtype": str(p.dtype).removeprefix("torch."),
        }
        for n, p in engine.module.named_parameters()
    }
    oracle = {
        "coords": coords,
        "masters": masters,
        "master_source": sources,
        "params": params,
        "module": {n: p.detach().clone() for n, p in engine.module.named_parameters() if spec["stage"] != 3},
        "buffers": {n: b.detach().clone() for n, b in engine.module.named_buffers()},
        "logits": logits,
    }
    if kind == "pipe" and spec["tp"] > 1:  # Megatron-style layers: the whole tensors, gathered over the tensor group
        oracle["whole_masters"] = gather_whole(engine.module, masters)
        oracle["whole_module"] = gather_whole(engine.module, oracle["module"])
        oracle["whole_moments"] = whole_moments(engine)
    torch.save(oracle, out / f"oracle.rank{rank}.pt")
    tag = f"global_step{engine.global_steps}"
    # a tensor-parallel pipeline's split rules, where Megatron-DeepSpeed puts them
    client_state = {"universal_checkpoint_info": universal_info(spec)} if kind == "pipe" and spec["tp"] > 1 else None
    if spec["save"] and spec["save_with"] == "ckptspec":
        _save_with_ckptspec(engine, out, rank, client_state)
    elif spec["save"] and client_state is not None:
        engine.save_checkpoint(str(out), client_state=client_state)
    elif spec["save"]:
        engine.save_checkpoint(str(out))
    dist.barrier()
    if rank == 0:
        if global_shapes is None:
            global_shapes = {n: list(p.shape) for n, p in reference_model(spec).named_parameters()}
        torch.save({"inputs": x}, out / "eval.pt")
        if consolidated is not None:
            torch.save(dict(consolidated), out / "consolidated.pt")
        info = {
            "spec": spec,
            "layout": layout(spec),
            "world_size": dist.get_world_size(),
            "deepspeed_version": deepspeed.__version__,
            "torch_version": torch.__version__,
            "optimizer_class": type(engine.optimizer).__name__,
            "tag": tag,
            "ranks": ranks,
            "global_shapes": global_shapes,
            "universal": _convert_universal(out, tag, spec) if spec["universal"] else None,
        }
        (out / "parallel.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    dist.barrier()
    if hasattr(engine, "destroy"):
        engine.destroy()

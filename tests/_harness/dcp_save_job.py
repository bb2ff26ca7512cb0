"""The ground truth of DCP as an input (issue #42): real FSDP2 jobs that save torch Distributed Checkpoints.

    torchrun --nproc_per_node N tests/_harness/dcp_save_job.py --tasks TASKS.json

Each task (``{"kind": "dcp_save", "args": {"spec"}, "out"}``): every rank builds the harness's tiny model
(job/model.py) in fp32, ``fully_shard``s ``l1``, ``l2`` and the root on a CPU mesh of all ranks (gloo),
makes ``torch.optim.AdamW`` with the spec's param groups, trains one step on a batch every rank shares and
saves the way a user does: ``dcp.save({"model": ..., "optim": ...}, checkpoint_id=OUT/dcp)`` from
``get_state_dict(model, optimizer)``. It trains a second step and saves again into ``OUT/dcp-step2``: a save
of the same layout and sizes, whose files the fault tests swap into the first (a chunk of another save).
Rank 0 writes ``OUT/oracle.pt``, each after its save:

  params        every model state dict entry (parameters as full_tensor(), the persistent buffers)
  state         per parameter: exp_avg, exp_avg_sq (full_tensor()) and step
  params2, state2   the same after the second step (the save in ``dcp-step2``)
  world_size    the job's

and ``OUT/torch_save.pt``: ``dcp_to_torch_save`` of ``OUT/dcp`` (torch's own consolidation, in one process).

No DeepSpeed and no ckptspec run here; the launch is its own (its cache key includes this file).
"""

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make `_harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness.fsdp2_job import serve
from _harness.job.model import SEQ, VOCAB, build_model, normalize_spec, param_groups

BATCH_SEED = 8765


def _full(t):
    """A copy of the whole tensor (at world size 1 full_tensor() can be the parameter's own storage)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _step(model, optimizer, spec, step: int) -> float:
    import torch

    g = torch.Generator().manual_seed(BATCH_SEED + step)  # the same batch on every rank
    tokens = torch.randint(0, VOCAB, (spec["micro_batch"], SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (spec["micro_batch"], SEQ), generator=g)
    optimizer.zero_grad()
    loss = model(tokens, targets)
    loss.backward()
    optimizer.step()
    return float(loss)


def _oracles(model, optimizer) -> tuple[dict, dict]:
    """Every model state dict entry (full) and every parameter's AdamW state (full): collectives, the same
    order on every rank."""
    names = {p: n for n, p in model.named_parameters()}
    params = {n: _full(t) for n, t in model.state_dict().items()}
    state = {}
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        state[names[p]] = {k: _full(v) for k, v in sorted(optimizer.state[p].items())}
    return params, state


def _save(model, optimizer, where: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(where))


def run(args, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    spec = normalize_spec(args["spec"])
    rank = dist.get_rank()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(spec["seed"])
    model = build_model(spec)
    for sub in (model.l1, model.l2):
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(param_groups(model, spec), lr=1e-2)

    losses = [_step(model, optimizer, spec, 1)]
    _save(model, optimizer, out / "dcp")
    params, state = _oracles(model, optimizer)
    losses.append(_step(model, optimizer, spec, 2))
    _save(model, optimizer, out / "dcp-step2")
    params2, state2 = _oracles(model, optimizer)
    dist.barrier()
    if rank == 0:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        result = {"params": params, "state": state, "params2": params2, "state2": state2}
        torch.save({**result, "world_size": dist.get_world_size()}, out / "oracle.pt")
        dcp_to_torch_save(str(out / "dcp"), str(out / "torch_save.pt"))
        (out / "dcp_save.json").write_text(json.dumps({"losses": losses}))


def main():
    serve(run)  # fsdp2_job.py's loop over the tasks, and its exit


if __name__ == "__main__":
    main()

"""The FSDP2 side of the DCP export's ground truth: load ``ckptspec export --format dcp`` into FSDP2.

    torchrun --nproc_per_node N tests/_harness/fsdp2_job.py --tasks TASKS.json

Each task (``{"kind": "fsdp2", "args": {"spec", "source", "load"}, "out"}``) names a DeepSpeed
checkpoint (``load``, a "train" entry with its live oracles) and the spec it was trained with; with
``"parallel": true`` it is a "parallel" entry (tensor/pipeline parallel, MoE, stage 0: its spec is
job/parallel_models.py's) and the model is the consolidated one (``reference_model``: tp1/pp1/ep1,
its children and the root ``fully_shard``ed, ``torch.optim.Adam`` with the job's param groups, MoE's
split as DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer`` splits them); it is
loaded the same way and records the same; its extra step is on ``parallel_batch`` with cross-entropy,
except a MoE's (``after`` is empty: its gate's training forward selects tokens at random and adds an
auxiliary loss, which the test does not replay).
Rank 0 exports it with the real CLI (in-process, ``ckptspec export LOAD OUT/dcp --format dcp``);
then every rank builds the same model in fp32, ``fully_shard``s ``l1``, ``l2`` and the root on a
CPU mesh of all ranks (gloo), makes ``torch.optim.AdamW`` with the job's param groups and loads the
export the way a user does: ``get_state_dict``, ``dcp.load``, ``set_state_dict``. It then trains one
step on a batch every rank shares. Rank 0 writes ``OUT/fsdp2.pt``:

  keys          the export's DCP keys, and the flattened keys of this job's own get_state_dict
  loaded        every model state dict entry after loading (parameters as full_tensor())
  state         per parameter: exp_avg, exp_avg_sq (full_tensor()) and step, after loading
  param_groups  the optimizer's param groups after loading (``params`` as names)
  after         every parameter after the extra step (full_tensor())
  batch_seed    the seed of the shared batch (the test replays the step with plain AdamW)

With ``"reader": true`` nothing is exported: every rank loads the checkpoint in place,
``dcp.load(state, storage_reader=ckptspec.DeepSpeedReader(LOAD))``, and rank 0 also records

  bytes_read    per rank: (checkpoint bytes its reader read, its share: the bytes of the boxes its
                shards hold, each tensor at its stored dtype (the steps are not read, a tie's
                parameter counts once), whether this
                rank validated the checkpoint rather than received rank 0's verdict)

and ``ranks``: per rank, its node (``GROUP_RANK`` of ``GROUP_WORLD_SIZE``, torchrun's), its local rank (of
``LOCAL_WORLD_SIZE``) and its parent process (the node's agent). Options of a reader task:

  mesh          ``[R, S]``: HSDP, a 2-D mesh (``"replicate"``, ``"shard"``), every unit ``fully_shard``ed on it
  group         ``"shard"``: the reader and ``dcp.load`` run on this rank's shard group (``process_group=``),
                so each replica validates and plans on its own
  http          ``{SETTING: value}`` of ``ckptspec.location.settings`` (small reads: the tensors are not in
                what validation fetched): rank 0 serves a copy of the checkpoint with the tests' nginx
                (servers.py, started here, so the entry does not depend on a server of the test session) and
                every rank reads it from its URL; rank 0 records ``http``: the URL, nginx's access log of the
                job, and ``mark``, the number of its requests before ``dcp.load`` (validation and planning
                done: the reader's ``read_metadata`` on every rank, then a barrier)

With ``"expect_error": true`` as well (a corrupt checkpoint, launched by the test itself), the load must
fail: each rank writes ``OUT/failure.rank<R>.json`` (the error's text, and whether every entry of the
model's state dict is as before the load) and goes on to the next task.

No DeepSpeed runs here; the launch is not the DeepSpeed job's, so its code is not in their cache key.
"""

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make `_harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness.job.model import SEQ, VOCAB, build_model, normalize_spec, param_groups

BATCH_SEED = 4321


def parallel_batch(spec):
    """The batch of a "parallel" entry's extra step (the consolidated model's inputs and classes)."""
    from _harness.job.parallel_models import batch

    return batch(spec, BATCH_SEED)


def parallel_layout(spec) -> str:
    from _harness.job.parallel_models import layout

    return layout(spec)


def shared_batch(spec):
    """The batch of the extra step: the same on every rank (and in the test's replay)."""
    import torch

    g = torch.Generator().manual_seed(BATCH_SEED)
    tokens = torch.randint(0, VOCAB, (spec["micro_batch"], SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (spec["micro_batch"], SEQ), generator=g)
    return tokens, targets


def _export(load: str, dcp_dir: Path) -> None:
    from ckptspec.cli import cli

    code = cli.main(["export", load, str(dcp_dir), "--format", "dcp", "--quiet"], standalone_mode=False)
    if code not in (None, 0):
        raise RuntimeError(f"ckptspec export exited {code}")


def _full(t):
    """A copy of the whole tensor (at world size 1 full_tensor() can be the parameter's own storage)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _parallel_model(spec, mesh):
    """The consolidated model of a "parallel" entry, sharded, and its optimizer (as job/parallel.py's)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from _harness.job.parallel_models import layout, reference_model

    torch.manual_seed(0)  # any weights: the export replaces them all
    model = reference_model(spec)
    # The param groups by name, before fully_shard replaces the parameters (and drops DeepSpeed's marks).
    names = {p: n for n, p in model.named_parameters()}
    if layout(spec) == "moe":
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "params"}
        )
    else:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    groups = [{**g, "params": [names[p] for p in g["params"]]} for g in groups]
    for child in model.children():  # a ModuleList has no forward: its members are the units
        for sub in child if isinstance(child, torch.nn.ModuleList) else [child]:
            if any(p.requires_grad for p in sub.parameters()):
                fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = dict(model.named_parameters())
    params = [{**g, "params": [sharded[n] for n in g["params"]]} for g in groups]
    return model, torch.optim.Adam(params, lr=1e-3)  # hyperparameters come from the export


def run(args, out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if args.get("parallel"):
        from _harness.job.parallel_models import normalize

        spec = normalize(args["spec"])
    else:
        spec = normalize_spec(args["spec"])
    rank = dist.get_rank()
    dcp_dir = out / "dcp"
    reader = server = group = None
    if args.get("mesh"):  # HSDP: replicated over the first dimension, sharded over the second
        mesh = init_device_mesh("cpu", tuple(args["mesh"]), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if args.get("reader"):  # the checkpoint in place, no export
        from ckptspec import DeepSpeedReader

        out.mkdir(parents=True, exist_ok=True)
        load = args["load"]
        if args.get("http"):
            from ckptspec.location import settings

            for setting, value in args["http"].items():
                setattr(settings, setting, value)
            server, load = _serve(load)
        if args.get("group"):
            group = mesh.get_group(args["group"])
        reader = DeepSpeedReader(load, process_group=group)
    elif rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        _export(args["load"], dcp_dir)
    dist.barrier()

    if args.get("parallel"):
        model, optimizer = _parallel_model(spec, mesh)
    else:
        torch.manual_seed(0)  # any weights: the export replaces them all
        model = build_model(spec)
        for sub in (model.l1, model.l2):
            fully_shard(sub, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(param_groups(model, spec), lr=1e-3)  # hyperparameters come from the export

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    own_keys = sorted(flatten_state_dict(state)[0])
    if args.get("expect_error"):
        _fail_to_load(model, state, reader, out)
        return
    mark = None
    if args.get("http"):  # validated and planned on every rank: what nginx sends next is the tensors
        reader.read_metadata()
        dist.barrier()
        mark = server.mark() if server is not None else None
    if reader is not None:
        dcp.load(state, storage_reader=reader, process_group=group)
    else:
        dcp.load(state, checkpoint_id=str(dcp_dir))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    names = {p: n for n, p in model.named_parameters()}
    loaded = {n: _full(t) for n, t in model.state_dict().items()}  # collective: same order on every rank
    moments = {}  # in param-group order: the same collective order on every rank
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        moments[names[p]] = {k: _full(v) for k, v in sorted(optimizer.state[p].items())}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
        for g in optimizer.param_groups
    ]

    loss, after = None, {}
    if not args.get("parallel"):
        tokens, targets = shared_batch(spec)
        loss = model(tokens, targets)
    elif parallel_layout(spec) != "moe":  # a MoE gate's training forward: random tokens, an auxiliary loss
        inputs, targets = parallel_batch(spec)
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    if loss is not None:
        loss.backward()
        optimizer.step()
        after = {n: _full(p) for n, p in model.named_parameters()}

    read = _bytes_read(state, reader) if reader is not None else None
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, _where())
    if rank == 0:
        metadata = reader.read_metadata() if reader is not None else dcp.FileSystemReader(str(dcp_dir)).read_metadata()
        dcp_keys = sorted(metadata.state_dict_metadata)
        result = {
            "keys": {"export": dcp_keys, "fsdp2": own_keys},
            "loaded": loaded,
            "state": moments,
            "param_groups": groups,
            "after": after,
            "batch_seed": BATCH_SEED,
            "world_size": dist.get_world_size(),
            "bytes_read": read,
            "ranks": ranks,
            "http": _served(server, load, mark) if server is not None else None,
        }
        torch.save(result, out / "fsdp2.pt")
        (out / "fsdp2.json").write_text(json.dumps({"loss": None if loss is None else float(loss)}))


def _where() -> dict:
    """Where this rank runs: its node and local rank as torchrun set them, and its agent (parent process)."""
    keys = ("GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return {**{k.lower(): int(os.environ[k]) for k in keys}, "agent": os.getppid()}


def _serve(load: str):
    """Rank 0: nginx serving a copy of ``load``; every rank: its URL (rank 0 also the server)."""
    import torch.distributed as dist

    server, url = None, [None]
    if dist.get_rank() == 0:
        import tempfile

        from _harness.servers import start_nginx

        server = start_nginx(Path(tempfile.mkdtemp(prefix="fsdp2-http-")))
        url = [server.url(server.serve(Path(load))[1])]
    dist.broadcast_object_list(url, src=0)
    return server, url[0]


def _served(server, url: str, mark: int) -> dict:
    """Rank 0, after the load: the URL, nginx's access log and the mark; the server stopped, its copy removed."""
    import shutil

    requests = server.since(0)
    server.stop()
    shutil.rmtree(server.work, ignore_errors=True)
    return {"url": url, "requests": requests, "mark": mark}


def _bytes_read(state, reader) -> list:
    """Per rank: (bytes its reader read, its share: each tensor's local shard at the stored dtype, steps aside,
    whether it validated the checkpoint)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    stored = reader.read_metadata().state_dict_metadata
    shards = {}  # a tie's names hold one parameter: its shard counts once
    for key, value in flatten_state_dict(state)[0].items():
        if isinstance(value, torch.Tensor) and not key.endswith(".step"):
            local = value.to_local() if hasattr(value, "to_local") else value
            itemsize = torch.empty((), dtype=stored[key].properties.dtype).element_size()
            shards[local.data_ptr() if local.numel() else key] = local.numel() * itemsize
    share = sum(shards.values())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (reader.bytes_read, share, reader.validated_here))
    return gathered


def _fail_to_load(model, state, reader, out: Path) -> None:
    """The load of a corrupt checkpoint: it must raise on this rank, and leave the model as it was."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    before = {n: _full(t) for n, t in model.state_dict().items()}
    try:
        dcp.load(state, storage_reader=reader)
        error = None
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        error = str(exc)
    after = {n: _full(t) for n, t in model.state_dict().items()}
    unchanged = before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    record = {"error": error, "unchanged": unchanged, "read": reader.bytes_read}
    (out / f"failure.rank{dist.get_rank()}.json").write_text(json.dumps(record))


def main():
    serve(run)


def serve(run_task) -> None:
    """Run ``--tasks``' tasks in order on every rank (``run_task(args, out)``), then leave: the entry of this job
    and of dcp_save_job.py, which share it."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", required=True, type=Path)
    tasks = json.loads(ap.parse_args().tasks.read_text())

    import torch
    import torch.distributed as dist

    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    for task in tasks:
        print(f"[harness] rank {dist.get_rank()}: {task['kind']} -> {task['out']}", flush=True)
        run_task(task["args"], Path(task["out"]))
        dist.barrier()
    # Every rank has finished every task. Leave without torch's teardown: with gloo after FSDP2, a rank
    # sometimes aborted in it ("terminate called without an active exception", SIGABRT, twice in ~10
    # cold suites, after the results were written), and torchrun then failed the whole launch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

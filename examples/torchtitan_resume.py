"""A torchtitan job resumes from a DeepSpeed checkpoint, read in place (issue #41).

    torchrun --nproc_per_node 2 examples/torchtitan_resume.py CHECKPOINT

It runs in its own environment, not the project's (torchtitan's dependencies are heavy):
``scripts/torchtitan-check.sh`` builds one and launches this on a cached harness checkpoint. Every rank
builds the harness model the DeepSpeed job trained (tests/_harness/job/model.py), ``fully_shard``s it on a
CPU mesh (gloo), and hands it to torchtitan's own pieces: ``OptimizersContainer`` (AdamW, the job's two
param groups by pattern) and ``CheckpointManager``, whose ``dcp_load`` a subclass points at
``ckptspec.DeepSpeedReader`` for a DeepSpeed checkpoint (``checkpoint.initial_load_path``); the keys go
through ``key_map``: the model's flat (``ModelWrapper``), the optimizer's FQN-keyed under ``optimizer``
(``state.<param>.<state>``, and each group's hyperparameters once per parameter:
``param_groups.<param>.<key>``).

Rank 0 then checks what the job holds against what DeepSpeed recorded when it saved (the cache entry's
``live_fp32.pt``, ``live_optim.pt``, its model-states files), as tests/_harness/dcp_oracles.py does:
every parameter's and Adam moment's ``full_tensor()`` bit for bit, each step, each group's hyperparameters,
frozen parameters and buffers; then one more training step against plain ``torch.optim.AdamW`` on the
consolidated state (bit for bit at world size 2). Then the job saves torchtitan's own checkpoint (``step-3``)
and restarts with the same arguments: torchtitan's own ``dcp_load`` resumes it, bit for bit. It prints what
it checked and exits 1 on a mismatch.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness model and its oracles

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.checkpointer.base import MODEL, OPTIMIZER
from torchtitan.components.checkpointer.dcp import CheckpointManager
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from ckptspec import DeepSpeedReader


def torchtitan_keys(optimizers: OptimizersContainer):
    """ckptspec's keys -> torchtitan's. A DeepSpeed group's hyperparameters go to each of its parameters'
    keys: torchtitan's groups must be in DeepSpeed's order (as its ``param_groups`` patterns make them)."""
    groups = [group["param_names"] for optim in optimizers for group in optim.param_groups]

    def key_map(key: str):
        kind, _, rest = key.partition(".")
        if kind == "model":
            return rest  # ModelWrapper: the model's own names, no prefix
        if rest.startswith("state."):
            return f"{OPTIMIZER}.{rest}"  # state.<param>.<exp_avg|exp_avg_sq|step>
        _, index, name = rest.split(".", 2)  # param_groups.<i>.<key>
        if name == "params":
            return None  # torchtitan keys groups by their parameters' names
        return [f"{OPTIMIZER}.param_groups.{fqn}.{name}" for fqn in groups[int(index)]]

    return key_map


class DeepSpeedCheckpointManager(CheckpointManager):
    """torchtitan's checkpoint manager, reading a DeepSpeed checkpoint in place; its own checkpoints as before."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if from_hf or not DeepSpeedReader.validate_checkpoint_id(checkpoint_id):
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        reader = DeepSpeedReader(checkpoint_id, key_map=torchtitan_keys(self.states[OPTIMIZER]))
        dcp.load(state_dict, storage_reader=reader)
        self.states[MODEL].load_state_dict(state_dict)  # as torchtitan's own dcp_load: the model is flattened
        self.bytes_read = reader.bytes_read  # (only a load from DeepSpeed's checkpoint sets it)


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def torchtitan_job(spec, mesh, checkpoint: Path, folder: str):
    """torchtitan's side of a job: the model sharded, its optimizers, its checkpoint manager (saving to
    ``folder``; its first load, with nothing there yet, from ``checkpoint``)."""
    from _harness.job.model import build_model

    torch.manual_seed(0)  # any weights: the checkpoint replaces them all
    model = build_model(spec)
    for sub in (model.l1, model.l2):
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    adamw = {"lr": 1e-3, "betas": (0.9, 0.95)}  # any: the checkpoint's hyperparameters replace them
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(
            param_groups=[  # DeepSpeed's groups, in its order: weights (decay 0.01), then biases (0)
                ParamGroupConfig(pattern=r"weight$", optimizer_name="AdamW", optimizer_kwargs=adamw),
                ParamGroupConfig(pattern=r"bias$", optimizer_name="AdamW", optimizer_kwargs=adamw),
            ],
            implementation="for-loop",
        ),
        model_parts=[model],
    )
    config = DeepSpeedCheckpointManager.Config(
        enable=True,
        folder=folder,
        interval=1,
        initial_load_path=str(checkpoint),
        initial_load_model_only=False,
        exclude_from_loading=["dataloader", "lr_scheduler"],  # the DeepSpeed job had neither
        keep_latest_k=0,
    )
    manager = DeepSpeedCheckpointManager(
        config,
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
    )
    return model, optimizers, manager


def held(model, optimizers):
    """Every model state dict entry and each parameter's Adam state (full_tensor()), the optimizer's groups.
    Collective: every rank, in the same order."""
    names = {p: n for n, p in model.named_parameters()}
    loaded = {n: _full(t) for n, t in model.state_dict().items()}
    optim = optimizers.optimizers[0]  # one AdamW: torchtitan batches groups of one optimizer type
    state = {
        names[p]: {k: _full(v) for k, v in sorted(optim.state[p].items())}
        for g in optim.param_groups
        for p in g["params"]
    }
    return loaded, state, [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]


def main(checkpoint: Path) -> int:
    import json
    import shutil

    from _harness.fsdp2_job import shared_batch
    from _harness.job.model import normalize_spec

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    spec = normalize_spec(json.loads((checkpoint / "harness.json").read_text())["spec"])
    mesh = init_device_mesh("cpu", (world_size,))
    folder = [tempfile.mkdtemp(prefix="torchtitan-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)  # torchtitan's own checkpoints: one folder for every rank

    model, optimizers, manager = torchtitan_job(spec, mesh, checkpoint, folder[0])
    assert manager.load(), "torchtitan loaded nothing"  # its folder is empty: the initial load, DeepSpeed's
    loaded, state, groups = held(model, optimizers)
    tokens, targets = shared_batch(spec)
    model(tokens, targets).backward()
    optimizers.step()
    after = {n: _full(p) for n, p in model.named_parameters()}
    _, stepped, _ = held(model, optimizers)
    assert manager.save(curr_step=3), "torchtitan saved nothing"  # its own checkpoint: step-3
    manager.close()
    read = [None] * world_size
    dist.all_gather_object(read, manager.bytes_read)

    # The job restarts with the same arguments: torchtitan resumes from its own step-3, not DeepSpeed's.
    again, again_optimizers, again_manager = torchtitan_job(spec, mesh, checkpoint, folder[0])
    assert again_manager.load() and not hasattr(again_manager, "bytes_read"), "not torchtitan's own load"
    again_manager.close()
    resumed, resumed_state, _ = held(again, again_optimizers)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0])
        failures = check(checkpoint, spec, loaded, state, groups, after)
        failures += [f"resumed {n}" for n, p in after.items() if not torch.equal(resumed[n], p)]
        failures += [
            f"resumed {n}.{k}"
            for n, s in stepped.items()
            for k, v in s.items()
            if not torch.equal(resumed_state[n][k], v)
        ]
        print(f"torchtitan's own step-3 checkpoint, resumed: {len(after)} parameters, {len(stepped)} Adam states")
        print(f"world size {world_size}, bytes read per rank {read}, mismatches: {len(failures)}")
        for failure in failures:
            print("MISMATCH", failure)
        code = 1 if failures else 0
    else:
        code = 0
    codes = [None] * world_size
    dist.all_gather_object(codes, code)
    return max(codes)


def check(checkpoint, spec, loaded, state, groups, after) -> list[str]:
    """Rank 0: what the job holds against DeepSpeed's records; each line printed as it is checked."""
    from _harness.dcp_oracles import _model_oracle, _replay_plain
    from _harness.job.model import build_model, param_groups
    from _harness.reconstruction import same_bits

    live = torch.load(checkpoint / "live_fp32.pt", weights_only=True)
    optim = torch.load(checkpoint / "live_optim.pt", weights_only=True)
    saved = _model_oracle(checkpoint, spec["stage"])
    failures = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    for name, theirs in live.items():  # the live engine's fp32 masters
        expect(loaded[name].dtype == torch.float32 and same_bits(loaded[name], theirs), f"master {name}")
    extras = sorted(set(loaded) - set(live))  # frozen parameters, buffers: as DeepSpeed saved them
    for name in extras:
        theirs = saved[name].reshape(-1)[: loaded[name].numel()].view(loaded[name].shape).to(loaded[name].dtype)
        expect(same_bits(loaded[name], theirs), f"saved {name}")
    print(f"masters: {len(live)} bit for bit ({', '.join(live)}); frozen and buffers: {', '.join(extras)}")
    expect(set(state) == set(optim["state"]) - {"head.weight"}, f"optimizer state of {sorted(state)}")
    moments = 0
    model = build_model(spec)  # the DeepSpeed job's groups, by name
    names = {p: n for n, p in model.named_parameters()}
    members = [[names[p] for p in group["params"]] for group in param_groups(model, spec)]
    for g, group in enumerate(groups):
        hyper = {k: v for k, v in group.items() if k != "param_names"}
        expect(group["param_names"] == members[g], f"group {g}: {group['param_names']} != {members[g]}")
        expect(hyper == optim["param_groups"][g], f"group {g}: {hyper} != {optim['param_groups'][g]}")
        for name in group["param_names"]:
            ours = state[name]
            expect(ours["step"].item() == optim["steps"][g], f"step of {name}: {ours['step'].item()}")
            for key in ("exp_avg", "exp_avg_sq"):
                expect(same_bits(ours[key], optim["state"][name][key]), f"{name}.{key}")
                moments += 1
    print(
        f"Adam: {moments} moments bit for bit, steps {sorted({float(s['step']) for s in state.values()})}, "
        f"{len(groups)} groups' hyperparameters equal the live optimizer's"
    )
    expected = _replay_plain(spec, live, optim, saved)
    for name, theirs in expected.items():
        expect(same_bits(after[name], theirs), f"{name} after one step")
        expect(not torch.equal(after[name], live[name]) if name in live else True, f"{name}: the step changed nothing")
    print(f"one more step: {len(expected)} parameters equal plain torch.optim.AdamW's bit for bit")
    return failures


if __name__ == "__main__":
    code = main(Path(sys.argv[1]))
    # Every rank has its verdict. Leave without torch's teardown: with gloo after FSDP2 a rank sometimes
    # aborts in it ("terminate called without an active exception", SIGABRT; as tests/_harness/fsdp2_job.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""The oracles of an FSDP2 job that loaded a DeepSpeed checkpoint through DCP (tests/_harness/fsdp2_job.py): from the
export (``export --format dcp``; tests/export/test_dcp.py, test_dcp_kinds.py) or in place through the reader
(``ckptspec.DeepSpeedReader``; tests/export/test_dcp_reader_jobs.py). Every oracle was recorded by DeepSpeed,
never by ckptspec.

``check_plain_load``: a ZeRO run of the plain model (DCP_SOURCES). The live engine's fp32 masters (``live_fp32.pt``)
and Adam state and step per optimizer group (``live_optim.pt``), recorded before it saved; the model-states files
read with torch for frozen parameters and buffers; DeepSpeed's own ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` where they are right (everywhere but round robin, harness.json). The job's extra
step is replayed with plain ``torch.optim.AdamW`` on the consolidated state and the same batch.

``check_parallel_load``: a tensor/pipeline-parallel, MoE or stage-0 run loaded into the consolidated model. Every
rank's live master (``oracle.rank<R>.pt``; a tensor rank's: its shard, cut by DeepSpeed's own affine pieces) and the
optimizer state DeepSpeed holds after loading the checkpoint (``<name>+optim``): moments, steps, groups and
hyperparameters. The extra step (all but MoE, whose gate's training forward selects tokens at random) is replayed
with plain ``torch.optim.Adam`` on the consolidated model from that state and the same batch.

The extra step is bit for bit at world sizes 1, 2 and 4 (every rank computes the same gradient, on the shared
batch; measured at 4 in the two-node and HSDP jobs, scenarios.DCP_READER_JOBS); at 3, FSDP2 averages each gradient
over three ranks (a sum, then a division), so an element can differ in the last bit (observed: at most 1.2e-7
absolute, 1.7e-7 relative).
"""

from __future__ import annotations

import json

from . import scenarios
from .fsdp2_job import parallel_batch, shared_batch
from .job.model import build_model, normalize_spec, param_groups
from .parallel_oracles import affine_pieces, bits_equal, check_masters, info, rank_oracles, shard_of
from .reconstruction import same_bits

SPECS = {**scenarios.MATRIX_SPECS, **scenarios.DCP_SOURCE_SPECS}
STEP_RTOL, STEP_ATOL = 1e-6, 1e-8


def _check_step(ours, theirs, world_size: int, what: str) -> None:
    import torch

    if world_size in (1, 2, 4):
        assert bits_equal(ours, theirs), what
    else:
        torch.testing.assert_close(ours, theirs, rtol=STEP_RTOL, atol=STEP_ATOL, msg=what)


def _model_oracle(save_dir, stage: int) -> dict:
    """Frozen parameters and buffers as DeepSpeed saved them (torch.load of the model states)."""
    import torch

    from ckptspec.deepspeed.layout.tag_dir import resolve_tag_dir

    files = [
        torch.load(p, map_location="cpu", weights_only=False)
        for p in sorted(resolve_tag_dir(save_dir).glob("*model_states.pt"))
    ]
    module, out = files[0]["module"], {}
    for name, tensor in module.items():
        if stage == 3 and name in (files[0].get("frozen_param_fragments") or {}):
            tensor = torch.cat([f["frozen_param_fragments"][name] for f in files])
        out[name] = tensor
    return out


def _replay_plain(spec, live_fp32, live_optim, frozen_and_buffers):
    """One step of plain torch.optim.AdamW on the consolidated state, on the job's shared batch."""
    import torch

    model = build_model(spec)  # fp32
    state = {}
    for name, ref in model.state_dict().items():
        value = live_fp32.get(name)
        if value is None:
            value = frozen_and_buffers[name].reshape(-1)[: ref.numel()].view(ref.shape).to(ref.dtype)
        state[name] = value
    model.load_state_dict(state)
    optimizer = torch.optim.AdamW(param_groups(model, spec))
    names = {p: n for n, p in model.named_parameters()}
    saved = optimizer.state_dict()
    index = {n: i for i, n in enumerate(names[p] for g in optimizer.param_groups for p in g["params"])}
    for g, group in enumerate(saved["param_groups"]):
        group.update(live_optim["param_groups"][g])
    for name, i in index.items():
        g = next(g for g, group in enumerate(optimizer.param_groups) if any(names[p] == name for p in group["params"]))
        saved["state"][i] = {
            "step": torch.tensor(live_optim["steps"][g], dtype=torch.float32),
            **{k: v.clone() for k, v in live_optim["state"][name].items()},
        }
    optimizer.load_state_dict(saved)
    tokens, targets = shared_batch(spec)
    model(tokens, targets).backward()
    optimizer.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def check_plain_load(ds, source: str, world_size: int, got: dict) -> None:
    """What the FSDP2 job of ``world_size`` holds after loading ``source`` (its ``fsdp2.pt``: ``got``)."""
    import torch

    spec = normalize_spec(json.loads(json.dumps(SPECS[source][0])))
    save_dir = ds.path(source)
    assert got["world_size"] == world_size
    live = torch.load(save_dir / "live_fp32.pt", weights_only=True)
    optim = torch.load(save_dir / "live_optim.pt", weights_only=True)
    harness = json.loads((save_dir / "harness.json").read_text())

    # The checkpoint has exactly the keys an FSDP2 job of this model asks for (and saves).
    assert got["keys"]["export"] == got["keys"]["fsdp2"]

    # DeepSpeed's getters are the oracle wherever they are right (not under round robin).
    if not spec["round_robin"]:
        assert harness["safe_get_full_fp32_param_mismatches"] == []
        assert harness["safe_get_full_optimizer_state_mismatches"] == {"exp_avg": [], "exp_avg_sq": []}

    # Masters bit for bit (a tie is one parameter: both names hold the same values).
    loaded = got["loaded"]
    assert live and set(live) <= set(loaded)
    for name, theirs in live.items():
        assert loaded[name].dtype == torch.float32 and same_bits(loaded[name], theirs), name
    # Frozen parameters and buffers: DeepSpeed's saved values (widened exactly to the fp32 model's dtype).
    saved = _model_oracle(save_dir, spec["stage"])
    for name in set(loaded) - set(live):
        ours = loaded[name]
        theirs = saved[name].reshape(-1)[: ours.numel()].view(ours.shape)
        assert same_bits(ours, theirs.to(ours.dtype) if theirs.is_floating_point() else theirs), name
    assert {"frozen.weight", "frozen.bias", "step_count", "running"} <= set(loaded) - set(live)

    # Adam's moments bit for bit, the step of each parameter's group, the hyperparameters.
    owners = {n for n in optim["state"] if n != "head.weight"}
    assert set(got["state"]) == owners
    for g, group in enumerate(got["param_groups"]):
        hyper = {k: v for k, v in group.items() if k not in ("params", "initial_lr")}
        assert hyper == {k: v for k, v in optim["param_groups"][g].items()}, g
        for name in group["params"]:
            state = got["state"][name]
            assert state["step"].item() == optim["steps"][g] == 2.0
            for key in ("exp_avg", "exp_avg_sq"):
                assert same_bits(state[key], optim["state"][name][key]), f"{name}.{key}"

    # One more step: plain AdamW on the consolidated state, same batch.
    expected = _replay_plain(spec, live, optim, saved)
    assert set(expected) == set(got["after"])
    for name, theirs in expected.items():
        ours = got["after"][name]
        _check_step(ours, theirs, world_size, f"{name} after one step")
        if name in live:
            assert not torch.equal(ours, live[name]), f"{name}: the step changed nothing"


def _optim_records(ds, source: str) -> list[dict]:
    import torch

    entry = ds.path(scenarios.optim_name(source))
    return [
        torch.load(entry / f"optim.rank{r}.pt", weights_only=True) for r in range(scenarios.REGISTRY[source].world_size)
    ]


def _replay_parallel(spec, got) -> dict:
    """One step of plain torch.optim.Adam on the consolidated model, from the loaded weights and state."""
    import torch

    from .job.parallel_models import reference_model

    model = reference_model(spec)
    model.load_state_dict(got["loaded"])
    names = dict(model.named_parameters())
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[n] for n in g["params"]]}
        for g in got["param_groups"]
    ]
    optimizer = torch.optim.Adam(groups)
    for group in got["param_groups"]:
        for name in group["params"]:
            optimizer.state[names[name]] = {k: v.clone() for k, v in got["state"][name].items()}
    inputs, targets = parallel_batch(spec)
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()
    optimizer.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def check_parallel_load(ds, source: str, world_size: int, got: dict) -> None:
    """What the FSDP2 job of ``world_size`` holds after loading the "parallel" entry ``source`` (``got``)."""
    import torch

    entry = ds.path(source)
    spec = info(entry)["spec"]
    assert got["world_size"] == world_size

    # The checkpoint has exactly the keys an FSDP2 job of the consolidated model asks for (and saves).
    assert got["keys"]["export"] == got["keys"]["fsdp2"]

    # Every rank's live master, bit for bit (a tensor-parallel rank's: its shard of the loaded whole).
    loaded = got["loaded"]
    assert all(t.dtype == torch.float32 for t in loaded.values())
    assert check_masters(entry, loaded) >= len(loaded)
    oracles = rank_oracles(entry)
    assert {o["params"][local]["global_name"] for o in oracles for local in o["masters"]} == set(loaded)

    # Adam's moments bit for bit, every parameter's step, group and hyperparameters, as DeepSpeed loads them.
    records = _optim_records(ds, source)
    coords = [o["coords"] for o in oracles]
    group_of = {name: g for g, group in enumerate(got["param_groups"]) for name in group["params"]}
    trainable = set()
    for rank, record in enumerate(records):
        assert record["param_groups"] == records[0]["param_groups"]
        for name, states in record["state"].items():
            trainable.add(name)
            ours = got["state"][name]
            assert set(ours) == {"exp_avg", "exp_avg_sq", "step"}, name
            for key, theirs in states.items():
                mine = ours[key]
                if spec["tp"] > 1:
                    tp = coords[rank]["tp"]
                    mine = shard_of(mine, affine_pieces(entry, tp, name), theirs.shape)
                assert bits_equal(mine, theirs), f"{source}: {name}.{key} (rank {rank})"
            assert ours["step"].item() == record["step"][name], name
            assert group_of[name] == record["group"][name], name
    assert set(got["state"]) == trainable == set(group_of)
    assert [{k: v for k, v in g.items() if k != "params"} for g in got["param_groups"]] == records[0]["param_groups"]

    # One more step (not for MoE: its gate's training forward selects tokens at random): what plain
    # torch.optim.Adam gives from the state just held against DeepSpeed's, on the same batch.
    if spec["ep"]:
        assert got["after"] == {}
        return
    expected = _replay_parallel(spec, got)
    assert set(expected) == set(got["after"]) == set(loaded)
    for name, theirs in expected.items():
        _check_step(got["after"][name], theirs, world_size, f"{name} after one step")
        assert not torch.equal(theirs, loaded[name]), f"{name}: the step changed nothing"

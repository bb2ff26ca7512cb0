"""The tiny model every real-DeepSpeed job of the tests trains, its DeepSpeed config, and the oracle
that reads the live engine's fp32 masters.

Runs inside the job (under torchrun): everything in this folder is part of the cache key of
every job (tests/_harness/cache.py).

Spec keys (JSON object) are listed in DEFAULTS; unknown keys are an error so typos do not
silently build the wrong checkpoint.
"""

import copy

DEFAULTS = {
    "stage": 2,  # ZeRO stage 0..3
    "dtype": "bf16",  # bf16 | fp16 | fp32
    "tied": False,  # head.weight = emb.weight
    "frozen": False,  # extra Linear with requires_grad=False
    "buffers": False,  # persistent buffers step_count/running + non-persistent scratch
    "two_groups": False,  # biases in a second param group with weight_decay 0
    "round_robin": False,  # zero_optimization.round_robin_gradients
    "parameter_alignment": False,  # zero_optimization.parameter_alignment (stage 1/2)
    "sub_group_size": None,  # zero_optimization.sub_group_size (stage 3)
    "exclude_frozen": False,  # save_checkpoint(exclude_frozen_parameters=True)
    "zero_elem": False,  # nn.Linear(8, 0, bias=False) and nn.Parameter(torch.zeros(0))
    "grad_accum_dtype": None,  # "fp32" with bf16 + stage 1 selects BF16_Optimizer
    "steps": 2,
    "seed": 1234,
    "micro_batch": 4,
    "save": True,  # False: train and run the hooks, but write no checkpoint
    "save_with": "deepspeed",  # "ckptspec": save through ckptspec.deepspeed.save_checkpoint (each rank
    # also writes the manifest it returned to saved_manifest.rank<N>.json)
    "hooks": [],  # names of functions in hooks.py, called as hook(engine, out_dir, spec) after saving
    "buckets": 2**16,  # ZeRO reduce/allgather bucket in elements; None: DeepSpeed's default (5e8)
    "zero": {},  # extra zero_optimization keys (override)
    "config": {},  # extra top-level DeepSpeed config keys (override)
}

VOCAB, DIM, HIDDEN, SEQ = 50, 16, 33, 8  # odd sizes so that partitions need padding


def normalize_spec(spec):
    unknown = set(spec) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown spec keys: {sorted(unknown)}")
    out = copy.deepcopy(DEFAULTS)
    out.update(copy.deepcopy(spec))
    if out["stage"] not in (0, 1, 2, 3) or out["dtype"] not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"bad stage/dtype in spec: {spec}")
    if out["save_with"] not in ("deepspeed", "ckptspec"):
        raise ValueError(f"bad save_with in spec: {spec}")
    if out["save_with"] == "ckptspec" and not out["save"]:
        raise ValueError(f"save_with ckptspec needs save: {spec}")
    if out["stage"] == 3 and out["zero_elem"]:
        # DeepSpeed 0.19.8 stage 3 fails in the first forward with zero-element params (AssertionError
        # in partitioned_param_coordinator._fetch_sub_module_impl: param status NOT_AVAILABLE).
        raise ValueError("zero_elem is not supported with stage 3")
    return out


def build_model(spec):
    import torch
    from torch import nn

    class TinyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM)
            self.l1 = nn.Linear(DIM, HIDDEN)
            self.l2 = nn.Linear(HIDDEN, DIM)
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            if spec["tied"]:
                self.head.weight = self.emb.weight
            if spec["frozen"]:
                self.frozen = nn.Linear(DIM, DIM)
                self.frozen.requires_grad_(False)
            if spec["buffers"]:
                self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
                self.register_buffer("running", torch.zeros(DIM))
                self.register_buffer("scratch", torch.zeros(4), persistent=False)
            if spec["zero_elem"]:
                self.z1 = nn.Linear(8, 0, bias=False)
                self.z2 = nn.Parameter(torch.zeros(0))

        def forward(self, tokens, targets):
            h = self.emb(tokens)
            if spec["frozen"]:
                h = h + self.frozen(h)
            h = self.l2(torch.relu(self.l1(h)))
            if spec["buffers"]:
                # Rank-independent updates, so every rank's copy of the buffers agrees.
                with torch.no_grad():
                    self.step_count += 1
                    self.running.add_(0.5)
                    self.scratch.add_(1.0)
            logits = self.head(h).float()
            return nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    return TinyModel()


def ds_config(spec):
    zero = {"stage": spec["stage"]}
    if spec["buckets"] is not None:
        # DeepSpeed's default buckets are 5e8 elements, which ZeRO touches page by page on every
        # task (1.3 GB per rank, most of a task's time in page faults). No part of the layout.
        zero["reduce_bucket_size"] = zero["allgather_bucket_size"] = spec["buckets"]
    if spec["round_robin"]:
        zero["round_robin_gradients"] = True
    if spec["parameter_alignment"]:
        zero["parameter_alignment"] = True
    if spec["sub_group_size"] is not None:
        zero["sub_group_size"] = spec["sub_group_size"]
    zero.update(spec["zero"])
    cfg = {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "zero_optimization": zero,
    }
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec["dtype"] == "fp16":
        # Small initial scale: overflow-skipped steps would leave the weights untouched.
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
    if spec["grad_accum_dtype"]:
        cfg["data_types"] = {"grad_accum_dtype": spec["grad_accum_dtype"]}
    cfg.update(spec["config"])
    return cfg


def param_groups(model, spec):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not spec["two_groups"]:
        return [{"params": [p for _, p in named]}]
    return [
        {"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.01},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]


def live_fp32(engine, model, stage):
    """Full fp32 master weights from the live engine (collective: call on every rank).

    Stage 0-2 use the optimizer's own buffers: a low-precision param is a view into the flat
    bit16 buffer, so its offset there is data_ptr arithmetic, independent of any checkpoint
    metadata. (safe_get_full_fp32_param is not used for stage 1/2 because its _hp_mapping
    ignores round_robin_gradients ordering.) Stage 3 has no flat lp buffer, so it uses
    DeepSpeed's per-param allgather.
    """
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    found = {}  # id(param) -> fp32 tensor

    opt = engine.optimizer
    if stage == 3:
        for _, p in model.named_parameters():
            if p.requires_grad:
                found[id(p)] = safe_get_full_fp32_param(p).detach().clone()
    elif hasattr(opt, "bit16_groups_flat") or hasattr(opt, "bf16_groups_flat"):
        if hasattr(opt, "bit16_groups_flat"):  # DeepSpeedZeroOptimizer (stage 1/2)
            groups, flats, parts = opt.bit16_groups, opt.bit16_groups_flat, opt.single_partition_of_fp32_groups
        else:  # BF16_Optimizer
            groups, flats, parts = opt.bf16_groups, opt.bf16_groups_flat, opt.fp32_groups_flat_partition
        for i, (group, flat, part) in enumerate(zip(groups, flats, parts)):
            pg = opt.real_dp_process_group[i]
            chunks = [torch.empty_like(part) for _ in range(dist.get_world_size(group=pg))]
            dist.all_gather(chunks, part.detach().contiguous(), group=pg)
            full = torch.cat(chunks)
            for p in group:
                off = (p.data_ptr() - flat.data_ptr()) // p.element_size()
                found[id(p)] = full[off : off + p.numel()].view(p.shape).clone()
    elif hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):  # stage 0 fp16/bf16 (unfused)
        for lp_group, fp32_group in zip(opt.fp16_groups, opt.fp32_groups):
            for p, m in zip(lp_group, fp32_group):
                found[id(p)] = m.detach().clone().view(p.shape)
    else:  # stage 0 fp32: the params are the master weights
        for p in model.parameters():
            if p.requires_grad:
                found[id(p)] = p.detach().clone()

    return {n: t for pid, t in found.items() if t.numel() > 0 for n in names[pid]}


def safe_get_mismatches(model, live, stage):
    """Names where DeepSpeed's safe_get_full_fp32_param disagrees with `live` (stage 1/2 only)."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    if stage not in (1, 2):
        return []
    bad = []
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in live:
            t = safe_get_full_fp32_param(p)  # collective: same order on every rank
            if t is None or not torch.equal(t.float(), live[n]):
                bad.append(n)
    return bad


def _flat_layout(opt):
    """(lp param groups, their flat lp buffers, the rank's fp32 partitions) of a stage 1/2 optimizer."""
    if hasattr(opt, "bit16_groups_flat"):  # DeepSpeedZeroOptimizer
        return opt.bit16_groups, opt.bit16_groups_flat, opt.single_partition_of_fp32_groups
    return opt.bf16_groups, opt.bf16_groups_flat, opt.fp32_groups_flat_partition  # BF16_Optimizer


def live_optimizer_state(engine, model, stage):
    """The optimizer's state per trainable parameter, read from the live engine (collective).

    Returns {"state": {name: {key: tensor in the param's shape}}, "steps": {optimizer group:
    step}, "param_groups": [hyperparameters without "params"]}. Stage 1/2 gather each group's
    flat state partitions (``optimizer.state[fp32 partition][key]``) over the ranks and slice them
    where the param sits in the flat low-precision buffer (data_ptr arithmetic, as live_fp32):
    DeepSpeed's own getter maps through _hp_mapping, which ignores round_robin_gradients. Stage 3
    uses DeepSpeed's per-param getter (grad_position: the real layout there).
    """
    import torch
    import torch.distributed as dist

    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    opt = engine.optimizer
    inner = opt.optimizer  # the client torch optimizer DeepSpeed wraps
    found, steps = {}, {}  # id(param) -> {key: tensor}; optimizer group -> step

    def per_element(state, flat):
        return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == flat.shape]

    if stage == 3:
        from deepspeed.utils import safe_get_full_optimizer_state

        first = inner.state[opt.fp32_partitioned_groups_flat[0]]
        keys = per_element(first, opt.fp32_partitioned_groups_flat[0])
        for j, flat in enumerate(opt.fp32_partitioned_groups_flat):
            steps[int(opt.sub_group_to_group_id[j])] = float(inner.state[flat]["step"])
        for _, p in model.named_parameters():
            if p.requires_grad:
                found[id(p)] = {k: safe_get_full_optimizer_state(p, k).detach().clone() for k in keys}
    elif stage in (1, 2):
        groups, flats, parts = _flat_layout(opt)
        for i, (group, flat, part) in enumerate(zip(groups, flats, parts)):
            state = inner.state[part]
            steps[i] = float(state["step"])
            pg = opt.real_dp_process_group[i]
            for key in per_element(state, part):
                chunks = [torch.empty_like(state[key]) for _ in range(dist.get_world_size(group=pg))]
                dist.all_gather(chunks, state[key].detach().contiguous(), group=pg)
                full = torch.cat(chunks)
                for p in group:
                    off = (p.data_ptr() - flat.data_ptr()) // p.element_size()
                    found.setdefault(id(p), {})[key] = full[off : off + p.numel()].view(p.shape).clone()
    param_groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    state = {n: s for pid, s in found.items() if all(t.numel() > 0 for t in s.values()) for n in names[pid]}
    return {"state": state, "steps": steps, "param_groups": param_groups}


def optimizer_state_getter(engine, model, live, stage):
    """What DeepSpeed's safe_get_full_optimizer_state says about `live` (collective).

    Returns (stale, mismatches). stale: the names whose getter would raise "not found in
    optimizer state fragment" as the engine stands: stage 1/2 link each lp param to its
    optimizer state once, after stepping the *first* param group only (_optimizer_step), so
    the params of every later group keep an empty link. It is read from the links, not by
    calling the getter: a rank that raises leaves the others waiting in the all_reduce. The
    links are then rebuilt (_lazy_init_hp_params_optimizer_state, as after load_checkpoint)
    and mismatches lists, per state key, the names where the getter disagrees with `live`.
    Equality is torch.equal: the getter sums fragments, which would turn a -0.0 into 0.0.
    """
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_optimizer_state

    if stage not in (1, 2, 3):
        return [], {}
    keys = sorted({k for s in live["state"].values() for k in s})
    mine = sorted(
        n
        for n, p in model.named_parameters(remove_duplicate=False)
        if getattr(p, "_hp_mapping", None) is not None
        and not set(keys) <= set(getattr(p._hp_mapping, "optim_fragment", ()))
    )
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    stale = sorted(set().union(*every))
    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    bad = {k: [] for k in keys}
    for n, p in model.named_parameters(remove_duplicate=False):
        if n not in live["state"]:
            continue
        for k in keys:
            t = safe_get_full_optimizer_state(p, k)  # collective: same order on every rank
            if t is None or not torch.equal(t.float(), live["state"][n][k]):
                bad[k].append(n)
    return stale, bad

"""What a resharded job holds besides its masters and optimizer state, after ``load_checkpoint``:
every frozen parameter (gathered at stage 3), every buffer and every tied parameter, each against the
source as DeepSpeed saved it. Used by the reshard resumes (resume.py with ``reshard``, and
tests/_harness/reshard_job.py); collective at stage 3 (parameters are gathered on every rank).

  frozen_checked / buffers_checked: the names compared with the source's saved values (torch.load
                   of its model-states files: the module, or at stage 3 the ranks'
                   ``frozen_param_fragments`` concatenated and trimmed)
  model_mismatched: the frozen parameters and buffers that differ, bit for bit
  tied_checked:    each tie (a second name of one parameter object, ``head.weight`` of ``emb.weight``)
  tied_mismatched: ties no longer the same object as their owner after loading, or whose weight is
                   not the source's live master of the owner cast to the model dtype (DeepSpeed
                   rebuilds the low-precision weights from the masters on load)
"""

from pathlib import Path


def saved_model(load: Path, frozen_names: list, tag: str = "global_step2") -> dict:
    """The source's frozen parameters and buffers as DeepSpeed saved them (torch.load, the oracle)."""
    import torch

    files = sorted((load / tag).glob("*model_states.pt"))
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    first = states[0]
    buffers = {n: first["module"][n] for n in first.get("buffer_names") or []}
    frozen = {}
    shapes = first.get("frozen_param_shapes") or {}
    if len(states) > 1:  # stage 3: each rank holds a ceil(numel / ws) fragment
        for name, shape in shapes.items():
            flat = torch.cat([s["frozen_param_fragments"][name].reshape(-1) for s in states])
            frozen[name] = flat[: torch.Size(shape).numel()].view(shape)
    else:  # stage 1/2: whole in the module (absent when excluded)
        frozen = {n: first["module"][n] for n in frozen_names if n in first["module"]}
    return {"frozen": frozen, "buffers": buffers}


def model_checks(model, stage: int, load: Path, masters: dict) -> dict:
    """Frozen parameters, buffers and ties of the job after loading, against the source (collective).
    ``masters``: the source job's live fp32 masters (``live_fp32.pt``)."""
    import deepspeed
    import torch

    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    seen, ties = {}, []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            ties.append((name, seen[id(p)]))
        else:
            seen[id(p)] = name
    gathered = [p for _, p in frozen] + [model.get_parameter(owner) for _, owner in ties]
    saved = saved_model(load, [n for n, _ in frozen])
    with deepspeed.zero.GatheredParameters(gathered, enabled=stage == 3):
        live = {n: p.detach().clone() for n, p in frozen}
        tied = {alias: model.get_parameter(alias).detach().clone() for alias, _ in ties}
    live.update({n: b.detach().clone() for n, b in model.named_buffers()})
    bad = sorted(
        n
        for n, t in {**saved["frozen"], **saved["buffers"]}.items()
        if n not in live or live[n].shape != t.shape or not torch.equal(live[n], t.to(live[n].dtype))
    )
    tied_bad = sorted(
        alias
        for alias, owner in ties
        if model.get_parameter(alias) is not model.get_parameter(owner)
        or owner not in masters
        or not torch.equal(tied[alias], masters[owner].to(tied[alias].dtype))
    )
    return {
        "frozen_checked": sorted(saved["frozen"]),
        "buffers_checked": sorted(saved["buffers"]),
        "model_mismatched": bad,
        "tied_checked": sorted(alias for alias, _ in ties),
        "tied_mismatched": tied_bad,
    }

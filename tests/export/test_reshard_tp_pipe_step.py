"""#40 ground truth for the tensor x pipeline moves (``reshard --tensor-parallel 1``, ``--pipeline-parallel Q`` at the
source's tensor degree, ``--tensor-parallel 4`` and back to 2): one more training step after resuming, at the target
layout, against the source job resumed at its own layout taking the same step (the job that never stopped).

Every optim_job.py task, after loading and recording, takes one step on the same global batch whatever the layout
(two micro batches, data rank d of D the d-th of D shares) and records again (``step.rank<R>.pt``): each
TP_PIPE_RESHARDS, TP_PIPE_STAGE_RESHARDS and TP_PIPE_SPLITS target in its own launch, the source's "+optim" entry
(scenarios.TP_PIPE_STEP_SOURCES) in the optim launch of the source's degrees. Both started from the same masters,
moments and step (bit for bit: test_reshard_tp_pipe.py, test_reshard_tp_pipe_stages.py, test_reshard_tp_pipe_split.py;
here the "+optim" entry's own record against the source job's gathered state), so any difference after the step is the
step's own arithmetic. Each tensor rank's masters and moments are put together whole (cut where the rank's parameter is
smaller than the whole one, in tensor rank order) and compared by global name.

Bit for bit where the tensor degree and data degree are the source's (only the stages moved, SAME_SUMS): every rank
computes the same matmuls on the same micro batches and reduces over the same tensor ranks. Otherwise within BOUNDS,
because the fp32 (or bf16) sums are taken in another order: a row-parallel block adds T partial sums of its
``down`` matmul (T = 1, 2 or 4: the merged block sums all H products in one matmul), which moves the loss and the
gradients by a few ulps of their precision, and Adam's first step on a gradient near zero divides it by its own size
(the masters' bound is a share of how far the step moved each tensor). Gradient clipping does not act at this step
(the gradient's norm, from the moments, is 0.67 to 0.82, below the saved ``clip_grad`` 1.0); a ``clip_grad`` written
wrong in the output still changes the step (CHANGELOG's mutation).
"""

from __future__ import annotations

import pytest
import torch
from _harness import scenarios
from _harness.parallel_oracles import bits_equal, gathered_whole, info, logits_of, optim_records
from _harness.scenarios import optim_name

MOVES = {**scenarios.TP_PIPE_RESHARDS, **scenarios.TP_PIPE_STAGE_RESHARDS, **scenarios.TP_PIPE_SPLITS}
CASES = sorted(MOVES)
KEYS = ("master", "exp_avg", "exp_avg_sq")


def _degrees(spec: dict, world_size: int) -> tuple[int, int]:
    """(tensor degree, data degree) of a job of ``spec`` at ``world_size``."""
    return spec["tp"], world_size // (spec["tp"] * spec["pp"])


# Only the number of stages changed (tp2 x pp2 <-> tp2 x pp1, one data rank): the same sums in the same order
SAME_SUMS = {
    n
    for n, (source, ws, _, _) in MOVES.items()
    if _degrees(scenarios.reshard_target(n)[2], ws) == _degrees(*scenarios.SOURCE_SPECS[source])
}
# How far the target's step may leave the source's, by the source's dtype: "element", each master element, as a
# share of the most the step moved its tensor; "fresh", the same for an element without history (``exp_avg_sq`` 0
# before the step: a ReLU unit that never fired); "norm", each tensor's whole difference as a share of the norm of
# the step's movement of it; "logits", the fixed batch's logits after the step as a share of the largest logit.
# Measured (docs/reshard.md): fp32 at most 3.0e-6 of the step (elements with history), 9.7e-5 (fresh: tp4 -> tp2,
# 2.up.weight, a first gradient of 2e-8, the size of Adam's eps 1e-8, so the step g / (|g| + eps) keeps a third of
# the gradient's relative rounding), 7.3e-6 of a tensor's norm, 1.6e-7 of the logits. bf16 at most 8.7% of the step
# (tp2 x pp2 -> tp1 x pp2 x dp2, 3.down.weight: elements with a short history, exp_avg_sq ~3e-11, whose gradient,
# a small sum of bf16 products, came out 6.9e-5 at one layout and 9.2e-5 at the other), 1.9% of a tensor's norm,
# 0.54% of the logits (one bf16 ulp).
BOUNDS = {
    "fp32": {"element": 1e-4, "fresh": 1e-3, "norm": 1e-4, "logits": 1e-6},
    "bf16": {"element": 0.15, "fresh": 0.15, "norm": 0.05, "logits": 0.01},
}


def _source(name: str) -> str:
    return MOVES[name][0]


def _whole(records: list[dict], shapes: dict[str, torch.Size]) -> dict[str, dict[str, torch.Tensor]]:
    """The whole tensors, by key ("master", "exp_avg", "exp_avg_sq") and global name: each tensor rank's (the first
    record of it: its data-parallel copies hold the same) joined along the axis where it is smaller than ``shapes``'s;
    a replicated tensor must be the same on every tensor rank."""
    by_rank: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for r in records:
        for name, master in r["master"].items():
            by_rank.setdefault((r["coords"]["tp"], name), {"master": master, **r["state"][name]})
    degree = 1 + max(t for t, _ in by_rank)
    out: dict[str, dict[str, torch.Tensor]] = {key: {} for key in KEYS}
    for name, shape in shapes.items():
        pieces = [by_rank[(t, name)] for t in range(degree)]
        axes = [i for i, (a, b) in enumerate(zip(pieces[0]["master"].shape, shape, strict=True)) if a != b]
        for key in KEYS:
            if not axes:  # replicated over the tensor ranks: each took the same step
                assert all(bits_equal(p[key], pieces[0][key]) for p in pieces), (name, key)
                out[key][name] = pieces[0][key]
            else:
                out[key][name] = torch.cat([p[key] for p in pieces], dim=axes[0])
            assert out[key][name].shape == shape, (name, key)
    return out


def _steps(records: list[dict]) -> set[float]:
    return {s for r in records for s in r["step"].values()}


@pytest.mark.parametrize("name", CASES)
def test_one_more_step_moves_the_target_as_it_moves_the_source(ds, name):
    source = ds.path(optim_name(_source(name)))
    whole = gathered_whole(ds.path(_source(name)))  # what the source job gathered when it saved
    shapes = {n: v.shape for n, v in whole["master"].items()}
    before, after = _whole(optim_records(source), shapes), _whole(optim_records(source, "step"), shapes)
    target_records = optim_records(ds.path(name), "step")
    target = _whole(target_records, shapes)
    # the reference resumed what the source saved, bit for bit (its masters, moments, step 2)
    for key in KEYS:
        for n, value in whole[key].items():
            assert bits_equal(before[key][n], value), (key, n)
    assert _steps(optim_records(source)) == {2.0}
    # the step happened at both layouts, from the same step count
    assert _steps(optim_records(source, "step")) == _steps(target_records) == {3.0}
    logits, expected = logits_of(target_records), logits_of(optim_records(source, "step"))
    assert not torch.equal(expected, logits_of(optim_records(source)))  # the step moved them
    if name in SAME_SUMS:
        for key in KEYS:
            for n, value in after[key].items():
                assert bits_equal(target[key][n], value), (key, n)
        assert bits_equal(logits, expected)
        return
    bound = BOUNDS[info(ds.path(_source(name)))["spec"]["dtype"]]
    for n, value in after["master"].items():
        moved = value - before["master"][n]
        step = moved.abs().max().item()  # the most the step moved this tensor
        assert step > 0, n
        off = (target["master"][n] - value).abs()
        share = torch.where(before["exp_avg_sq"][n] == 0, bound["fresh"], bound["element"])
        assert (off <= share * step + 1e-7).all(), (n, off.max().item(), step)
        assert (off.norm() <= bound["norm"] * moved.norm()).item(), (n, off.norm().item(), moved.norm().item())
    diff = (logits.float() - expected.float()).abs().max().item()
    assert diff <= bound["logits"] * expected.float().abs().max().item(), diff

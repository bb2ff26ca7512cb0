"""How far one more step at a reshard's target layout leaves the masters and logits from the job that never stopped.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/one_more_step_maxima.py

Reads the real DeepSpeed results ``tests/export/test_reshard_one_more_step.py`` compares (built by the suite into
``.cache/ds``, or ``$CKPTSPEC_DS_CACHE``; a missing one is built) and prints, per case, the largest difference of a
master (as a share of how far the step moved that tensor, where the tensor degree is the same) and of the logits (as
a share of the largest logit), then the maxima by dtype: the numbers ``docs/reshard.md`` ("One more step, every
other move") quotes and the test's bounds are set from. The cases the test treats apart (the DeepSpeed fp16 stage-0
defect, the ReLU-edge elements, the AutoTP stage-0 clipping factor) are marked and left out of the maxima.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "export")]

from _harness import tasks
from _harness.parallel_oracles import logits_of, optim_records
from _harness.scenarios import optim_name
from test_reshard_one_more_step import (
    AUTOTP_FROM_STAGE0_CLIP,
    AUTOTP_STAGE0_CLIP,
    CASES,
    FP16_STAGE0,
    ZERO3_EDGE,
    _bounds,
    _masters,
    _source,
)

APART = FP16_STAGE0 | ZERO3_EDGE | AUTOTP_STAGE0_CLIP | AUTOTP_FROM_STAGE0_CLIP


def measure(name: str) -> tuple[float | None, float]:
    """(largest master difference / that tensor's step, or None at another tensor degree; logits difference /
    largest logit)."""
    source = tasks.path(optim_name(_source(name)))
    before, after = optim_records(source), optim_records(source, "step")
    target = optim_records(tasks.path(name), "step")
    moved, held, reference = _masters(before), _masters(target), _masters(after)
    share = None
    if held and {k[0] for k in held} == {k[0] for k in reference}:
        share = max(float(np.abs(held[k] - v).max() / np.abs(v - moved[k]).max()) for k, v in reference.items())
    logits, expected = logits_of(target), logits_of(after)
    return share, (logits - expected).abs().max().item() / expected.abs().max().item()


def main() -> None:
    print("| case | dtype bounds | masters (share of the step) | logits (share of the largest) |")
    print("|---|---|---:|---:|")
    worst: dict[str, list[float]] = {}
    for name in CASES:
        share, logits = measure(name)
        kind = "moe-bf16-expert-degree" if _bounds(name)[0] == 0.5 else "fp32" if _bounds(name)[0] < 1e-3 else "bf16"
        mark = " (treated apart)" if name in APART else ""
        print(f"| {name}{mark} | {kind} | {'-' if share is None else f'{share:.2g}'} | {logits:.2g} |")
        if name not in APART:
            row = worst.setdefault(kind, [0.0, 0.0, 0])
            row[0], row[1], row[2] = max(row[0], share or 0.0), max(row[1], logits), row[2] + 1
    print()
    print("| bounds | cases | largest master share | largest logits share |")
    print("|---|---:|---:|---:|")
    for kind, (share, logits, count) in sorted(worst.items()):
        print(f"| {kind} | {count} | {share:.2g} | {logits:.2g} |")
    print(f"\n{len(CASES)} cases, {len(CASES) - len(APART & set(CASES))} in the maxima")


if __name__ == "__main__":
    main()

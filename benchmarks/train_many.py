"""Train a model made of N tiny parameter tensors with real DeepSpeed and save a ZeRO checkpoint.

Run under torchrun by make_many_tensors.py:

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/train_many.py --tensors 10000 --stage 2 --out DIR

The model is a stack of small residual cells, each ``h + gate * lin(norm(h))``, so every
tensor takes part in the forward pass (ZeRO-3 gathers params per submodule, so the cells
must really run). It holds exactly ``--tensors`` distinct parameter tensors in a mix of
shapes (2-D weights (8, 8) and (16, 8), 1-D biases and norms, (1,) gates, a few 3-D extras),
with every 10th cell's norm frozen, every 50th cell's weight tied to that of the cell two back,
two optimizer param groups (decay / no decay) and two persistent buffers.

Rank 0 writes DIR/bench.json with the tensor counts and the time DeepSpeed spent in each
phase (the point of the exercise: DeepSpeed's per-param Python loops grow with N too).

DeepSpeed 0.19.8's ``DeepSpeedEngine._check_for_duplicates`` (engine.py L2281-2292), run by
``deepspeed.initialize``, rebuilds the id list of every param group once per parameter:
O(N^2), 72 s at 10k tensors and 736 s at 25k here, hours at 100k. Unless
``--quadratic-duplicate-check`` is given, it is replaced by the same assertion done in one
pass (it only checks that no param is listed twice; the checkpoint is unaffected), and
bench.json records that.
"""

import argparse
import collections
import json
import time
from pathlib import Path

DIM = 8  # every cell maps DIM -> DIM; small, so 100k tensors stay ~2M elements
CELL_TENSORS = 5  # lin.weight, lin.bias, norm.weight, norm.bias, gate
FROZEN_EVERY, TIED_EVERY = 10, 50


def layout(n_tensors: int) -> tuple[int, int]:
    """(cells, extra tensors) so that the model holds exactly ``n_tensors`` distinct params.

    A tied cell contributes one tensor fewer (its weight is another cell's); the extras
    make up for those and for the remainder of the division."""
    cells = n_tensors // CELL_TENSORS
    tied = len(range(TIED_EVERY, cells, TIED_EVERY))
    return cells, n_tensors - (cells * CELL_TENSORS - tied)


def build_model(n_tensors: int):
    import torch
    from torch import nn

    cells, extra = layout(n_tensors)

    class Cell(nn.Module):
        def __init__(self, wide):
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            # A wide cell projects to 2*DIM and folds back, for a second weight shape.
            self.lin = nn.Linear(DIM, 2 * DIM if wide else DIM)
            self.gate = nn.Parameter(torch.full((1,), 0.01))

        def forward(self, h):
            out = self.lin(self.norm(h))
            if out.shape[-1] != DIM:
                out = out[..., :DIM] + out[..., DIM:]
            return h + self.gate * out

    class ManyTensors(nn.Module):
        def __init__(self):
            super().__init__()
            self.cells = nn.ModuleList(Cell(wide=i % 4 == 1) for i in range(cells))
            for i, cell in enumerate(self.cells):
                if i % FROZEN_EVERY == FROZEN_EVERY - 1:
                    cell.norm.requires_grad_(False)
                if i and i % TIED_EVERY == 0:
                    # i is even, so i and i - 2 are both narrow cells: same weight shape.
                    cell.lin.weight = self.cells[i - 2].lin.weight
            # Leftover tensors, in a few odd shapes (3-D included), used by a cheap reduction.
            shapes = [(3,), (2, 5), (2, 3, 4), (7,)]
            self.extras = nn.ParameterList(
                nn.Parameter(torch.randn(shapes[k % len(shapes)]) * 0.01) for k in range(extra)
            )
            self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
            self.register_buffer("running", torch.zeros(DIM))

        def forward(self, x):
            h = x
            for cell in self.cells:
                h = cell(h)
            loss = h.float().pow(2).mean()
            for p in self.extras:  # direct params of this module: gathered with it under ZeRO-3
                loss = loss + p.float().pow(2).sum() * 1e-3
            with torch.no_grad():
                self.step_count += 1
                self.running.add_(0.5)
            return loss

    model = ManyTensors()
    distinct = len(list(model.parameters()))
    assert distinct == n_tensors, (distinct, n_tensors)
    return model


def use_linear_duplicate_check() -> None:
    """Swap DeepSpeed's O(N^2) duplicate-param check for the same assertion in O(N)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    def check_for_duplicates(self, optimizer):
        counts = collections.Counter(id(p) for group in optimizer.param_groups for p in group["params"])
        for name, param in self.module.named_parameters():
            assert counts[id(param)] <= 1, (
                f"Parameter with name: {name} occurs multiple times in optimizer.param_groups."
            )

    DeepSpeedEngine._check_for_duplicates = check_for_duplicates


def param_groups(model):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.01},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, required=True)
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], required=True)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quadratic-duplicate-check", action="store_true", help="keep DeepSpeed's own O(N^2) check")
    args = ap.parse_args()

    import deepspeed
    import torch
    import torch.distributed as dist

    times = {}

    def phase(name, t0):
        dist.barrier()
        times[name] = round(time.perf_counter() - t0, 2)
        return time.perf_counter()

    torch.manual_seed(0)
    deepspeed.init_distributed()
    if not args.quadratic_duplicate_check:
        use_linear_duplicate_check()
    t = time.perf_counter()
    model = build_model(args.tensors)
    t = phase("build_model_s", t)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.stage},
    }
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    t = phase("initialize_s", t)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        loss = engine(torch.randn(2, DIM, generator=g).to(torch.bfloat16))
        engine.backward(loss)
        engine.step()
    t = phase("train_steps_s", t)
    engine.save_checkpoint(str(args.out))
    t = phase("save_checkpoint_s", t)
    if dist.get_rank() == 0:
        params = list(model.parameters())
        numel = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params)
        frozen = sum(not p.requires_grad for p in params)
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        (args.out / "bench.json").write_text(
            json.dumps(
                {
                    "stage": args.stage,
                    "world_size": dist.get_world_size(),
                    "tensors": len(params),
                    "frozen_tensors": frozen,
                    "tied_aliases": len(names) - len(params),
                    "params": numel,
                    "steps": args.steps,
                    "deepspeed": deepspeed.__version__,
                    "torch": torch.__version__,
                    "linear_duplicate_check": not args.quadratic_duplicate_check,
                    "deepspeed_times": times,
                },
                indent=1,
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

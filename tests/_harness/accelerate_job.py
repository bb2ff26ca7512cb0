"""The ground truth of the accelerate integration (issue #43): ``Accelerator(deepspeed_plugin=...)`` runs.

    torchrun --nproc_per_node N tests/_harness/accelerate_job.py --tasks TASKS.json

Each task (``{"kind": "accelerate", "args": {"stage", "seed"}, "out"}``): every rank builds a small MLP (seeded),
``torch.optim.AdamW``, a seeded data loader, and prepares them with an ``Accelerator`` on DeepSpeed ZeRO ``stage``
(gloo, CPU); it trains two steps and saves with ``ckptspec.integrations.accelerate.save_state(OUT/run/step2)``,
then two more (``OUT/run/step4``). At each save rank 0 writes the fp32 masters DeepSpeed holds
(``safe_get_full_fp32_param``, by the module's parameter names) to ``OUT/masters-stepN.pt``.

Then rank 0 copies ``step4`` to ``OUT/corrupt`` and cuts a byte off its rank-1 optimizer file (``CORRUPTED``); every
rank calls ``load_state(OUT/corrupt)`` (expected to raise before DeepSpeed reads anything: the masters after it are
step 4's) and ``load_state(OUT/run/step2)``; ``OUT/resume.json`` holds each rank's outcome, ``OUT/after-refused.pt``
and ``OUT/loaded-step2.pt`` the masters after each.

No other job runs here; the launch is of its own (its cache key includes this file).
"""

import json
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make `_harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness.fsdp2_job import serve
from _harness.trainer_job import outcome

CORRUPTED = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def masters(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}


def run(args, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator, DeepSpeedPlugin

    from ckptspec.integrations.accelerate import load_state, save_state

    rank = dist.get_rank()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 4}
    # small buckets: DeepSpeed's default (5e8 elements) is a 2 GB buffer per micro step that torch fills with NaN
    # under use_deterministic_algorithms (trainer_job.BUCKETS)
    buckets = {"reduce_bucket_size": 2**16, "allgather_bucket_size": 2**16, "stage3_prefetch_bucket_size": 2**16}
    plugin = DeepSpeedPlugin(hf_ds_config={**config, "zero_optimization": {"stage": args["stage"], **buckets}})
    accelerator = Accelerator(deepspeed_plugin=plugin)
    torch.manual_seed(args["seed"])
    model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(args["seed"])
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g))
    engine, optimizer, loader = accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(data, batch_size=2))

    batches = iter(loader)
    for step in range(1, 5):
        x, y = next(batches)
        accelerator.backward(torch.nn.functional.mse_loss(engine(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if step % 2 == 0:
            save_state(accelerator, str(out / "run" / f"step{step}"))
            found = masters(engine)
            if rank == 0:
                torch.save(found, out / f"masters-step{step}.pt")

    corrupt = out / "corrupt"
    if rank == 0:
        shutil.copytree(out / "run" / "step4", corrupt)
        victim = corrupt / "pytorch_model" / CORRUPTED
        victim.write_bytes(victim.read_bytes()[:-1])
    dist.barrier()
    refused = outcome(lambda: load_state(accelerator, str(corrupt)) and None)
    after_refused = masters(engine)
    loaded = outcome(lambda: load_state(accelerator, str(out / "run" / "step2")) and None)
    after_load = masters(engine)
    outcomes: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, {"refused": refused, "loaded": loaded})
    if rank == 0:
        (out / "resume.json").write_text(json.dumps(outcomes, indent=1))
        torch.save(after_refused, out / "after-refused.pt")
        torch.save(after_load, out / "loaded-step2.pt")


def main():
    serve(run)  # fsdp2_job.py's loop over the tasks, and its exit


if __name__ == "__main__":
    main()

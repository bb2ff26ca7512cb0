"""The ground truth of the Hugging Face Trainer integration (issue #43): real ``Trainer`` runs on DeepSpeed.

    torchrun --nproc_per_node N tests/_harness/trainer_job.py --tasks TASKS.json

Each task (``{"kind": "trainer", "args": {"stage", "steps", "save_steps", "seed"}, "out"}``): every rank builds
a tiny GPT-2 (2 layers, width 32, no dropout, tied embeddings) and trains it with ``transformers.Trainer``
(``TrainingArguments(deepspeed=CONFIG, use_cpu=True)``, ZeRO ``stage``, the Trainer's own AdamW handed to
DeepSpeed: an optimizer in the config would JIT-build DeepSpeed's FusedAdam for minutes) with
``ckptspec.integrations.transformers.CkptspecCallback``, saving ``OUT/run/checkpoint-N`` every ``save_steps``.
A recording callback writes, at each save, every parameter's fp32 master as DeepSpeed holds it
(``safe_get_full_fp32_param``, by the model's parameter names) to ``OUT/masters-stepN.pt`` (rank 0).

Then the resume: rank 0 copies the run to ``OUT/corrupt`` and truncates the newest checkpoint's rank-1 optimizer
file by a byte (``CORRUPTED``); every rank calls ``resume_from(OUT/corrupt)`` (expected to raise) and
``resume_from(OUT/corrupt, fallback=True)``; ``OUT/resume.json`` holds each rank's outcome of both. A second
Trainer (same arguments, output ``OUT/corrupt``) then trains from the folder the fallback returned to ``steps``:
``OUT/resumed-begin.pt`` holds its masters at ``on_train_begin`` (after DeepSpeed's load), ``OUT/resumed-stepN.pt``
at its saves (the newest rewrites the truncated folder, the callback recording the files DeepSpeed rewrote).

No other DeepSpeed job runs here; the launch is of its own (its cache key includes this file).
"""

import json
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make `_harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness.fsdp2_job import serve

CORRUPTED = "zero_pp_rank_1_mp_rank_00_optim_states.pt"  # in the newest checkpoint's tag, one byte short
WIDTH, VOCAB, SEQ, SAMPLES = 32, 64, 16, 64
# ZeRO's buckets, in elements (the model has < 40k parameters). DeepSpeed's default, 5e8, is a 2 GB buffer ZeRO-2
# allocates at every micro step, which torch fills with NaN under use_deterministic_algorithms: measured with py-spy,
# 95% of the training loop's time (28 s a rank for 8 micro steps).
BUCKETS = {"reduce_bucket_size": 2**16, "allgather_bucket_size": 2**16, "stage3_prefetch_bucket_size": 2**16}


def build_model(seed: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0)
    config.eos_token_id = 0
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # the resume replays the same steps
    return GPT2LMHeadModel(config)


def dataset():
    import torch

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return SAMPLES

        def __getitem__(self, i):
            ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    return Tokens()


def masters(model) -> dict:
    """Every parameter's fp32 master (collective at ZeRO-3: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).detach().clone() for name, p in model.named_parameters()}


def recorder(out: Path, prefix: str):
    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def _write(self, name: str, model) -> None:
            found = masters(model)
            if dist.get_rank() == 0:
                torch.save(found, out / name)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if prefix == "resumed":
                self._write("resumed-begin.pt", model)

        def on_save(self, args, state, control, model=None, **kwargs):
            self._write(f"{prefix}-step{state.global_step}.pt", model)

    return Record()


def trainer(args: dict, output_dir: Path, out: Path, prefix: str):
    from transformers import Trainer, TrainingArguments

    from ckptspec.integrations.transformers import CkptspecCallback

    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "zero_optimization": {"stage": args["stage"], **BUCKETS},
    }
    training = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        max_steps=args["steps"],
        save_steps=args["save_steps"],
        save_strategy="steps",
        learning_rate=1e-2,
        seed=args["seed"],
        deepspeed=config,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
    )
    callbacks = [CkptspecCallback(), recorder(out, prefix)]
    return Trainer(model=build_model(args["seed"]), args=training, train_dataset=dataset(), callbacks=callbacks)


def outcome(call) -> dict:
    try:
        return {"returned": call()}
    except Exception as exc:
        findings = [f.to_dict() for f in getattr(exc, "findings", [])]
        return {
            "raised": type(exc).__name__,
            "code": getattr(exc, "code", None),
            "text": str(exc),
            "findings": findings,
        }


def run(args, out: Path) -> None:
    import torch.distributed as dist

    from ckptspec.integrations.transformers import resume_from

    rank = dist.get_rank()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    first = trainer(args, out / "run", out, "run")
    first.train()

    corrupt = out / "corrupt"
    if rank == 0:
        shutil.copytree(out / "run", corrupt)
        newest = corrupt / f"checkpoint-{args['steps']}" / f"global_step{args['steps']}" / CORRUPTED
        newest.write_bytes(newest.read_bytes()[:-1])
    dist.barrier()
    refused = outcome(lambda: resume_from(corrupt))
    picked = outcome(lambda: resume_from(corrupt, fallback=True))
    outcomes: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, {"refused": refused, "fallback": picked})
    if rank == 0:
        (out / "resume.json").write_text(json.dumps(outcomes, indent=1))
    if "returned" in picked:
        second = trainer(args, corrupt, out, "resumed")
        second.train(resume_from_checkpoint=picked["returned"])


def main():
    serve(run)  # fsdp2_job.py's loop over the tasks, and its exit


if __name__ == "__main__":
    main()

"""Train a tiny Hugging Face GPT-2 for two steps with DeepSpeed ZeRO-2 (bf16) and save it with ckptspec.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 examples/hf_gpt2/train.py --out OUT

Writes OUT/checkpoint/ (the DeepSpeed checkpoint, with its ckptspec manifest), OUT/config.json
(the model's config, for `from_pretrained` later) and OUT/reference.safetensors: the live
engine's fp32 master weights just before saving, plus the logits a plain fp32 model with those
weights gives on a fixed input. load.py compares the reconstructed model against them.
"""

import argparse
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

CONFIG = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 10**6,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2},
}
PROBE = torch.arange(16).remainder(CONFIG.vocab_size).view(1, 16)  # the fixed input of the logits check


def fp32_masters(model) -> dict[str, torch.Tensor]:
    """The optimizer's fp32 master of every parameter (collective: every rank calls it, in the same order)."""
    return {name: safe_get_full_fp32_param(p).detach().clone() for name, p in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    save_dir = str(args.out / "checkpoint")

    torch.manual_seed(0)  # the same initial weights on every rank
    deepspeed.init_distributed()
    rank = dist.get_rank()
    model = GPT2LMHeadModel(CONFIG)  # lm_head.weight is transformer.wte.weight (tied)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)

    for step in range(2):
        tokens = torch.randint(
            0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank * 100 + step)
        )
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()

    masters = fp32_masters(model)

    from ckptspec.deepspeed import save_checkpoint

    manifest = save_checkpoint(engine, save_dir)  # instead of engine.save_checkpoint(save_dir)

    if rank == 0:
        reference = GPT2LMHeadModel(CONFIG).eval()
        reference.load_state_dict(masters, strict=False)  # lm_head.weight follows its tie
        torch.set_num_threads(1)  # as in load.py, so both compute the logits the same way
        with torch.no_grad():
            logits = reference(PROBE).logits
        tensors = {f"master.{name}": t for name, t in masters.items()}
        save_file({**tensors, "probe": PROBE, "logits": logits}, str(args.out / "reference.safetensors"))
        CONFIG.save_pretrained(args.out)
        print(f"saved {save_dir}: ZeRO-{manifest.layout.zero_stage}, {len(manifest.files)} files described")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

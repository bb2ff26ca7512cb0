"""Train a ~100M-parameter model for one step with real DeepSpeed and save a ZeRO checkpoint.

Run under torchrun by make_big_checkpoint.py:

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/train_big.py --stage 2 --out DIR
"""

import argparse
import json
from pathlib import Path

VOCAB, DIM, HIDDEN, LAYERS = 32000, 1024, 4096, 4  # 2 x 32.8M (emb, head) + 4 x 8.4M = 99.3M params


def build_model(layers: int = LAYERS):
    import torch
    from torch import nn

    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)) for _ in range(layers)
            )
            self.norm = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            self.register_buffer("step_count", torch.zeros((), dtype=torch.long))

        def forward(self, tokens, targets):
            h = self.emb(tokens)
            for layer in self.layers:
                h = h + layer(h)
            logits = self.head(self.norm(h)).float()
            with torch.no_grad():
                self.step_count += 1
            return nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    return Big()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=LAYERS, help="more layers: a bigger model, same largest tensor")
    args = ap.parse_args()

    import deepspeed
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    deepspeed.init_distributed()
    model = build_model(args.layers)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.stage},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, VOCAB, (1, 16), generator=g)
    loss = engine(tokens, torch.roll(tokens, 1, 1))
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(args.out))
    if dist.get_rank() == 0:
        params = (
            sum(p.numel() for p in model.parameters())
            if args.stage < 3
            else sum(p.ds_numel for p in model.parameters())
        )
        (args.out / "bench.json").write_text(
            json.dumps(
                {
                    "stage": args.stage,
                    "world_size": dist.get_world_size(),
                    "params": params,
                    "deepspeed": deepspeed.__version__,
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

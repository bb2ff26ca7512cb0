"""Train a ~100M-parameter model for one step with real DeepSpeed and save a ZeRO checkpoint.

Run under torchrun by make_big_checkpoint.py:

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/train_big.py --stage 2 --out DIR

make_scale_checkpoint.py runs it with a wider, deeper model (``--dim --hidden --layers``) and, at
ZeRO-3, ``--zero-init``: the parameters are partitioned as they are created
(``deepspeed.zero.Init``), so no rank ever holds the whole model in fp32.

Model-parallel kinds (make_big_checkpoint.py ``--tp`` / ``--experts``), as the test harness's ``tp2-*`` and
``moe-ep2-*`` jobs train them (tests/_harness/job/parallel_models.py):
``--tp T``: AutoTP (``tensor_parallel.autotp_size``), every block's first Linear column-parallel and its second
row-parallel by explicit ``layer_specs``, the embedding and head left whole; the batch is seeded by the
data-parallel rank (a tensor group sees the same batch).
``--experts E --ep P``: every block a ``deepspeed.moe.layer.MoE`` of E copies of the block on P expert-parallel
ranks (top-1 gate), the optimizer's groups split by ``split_params_into_different_moe_groups_for_optimizer``.
"""

import argparse
import json
import time
from pathlib import Path

VOCAB, DIM, HIDDEN, LAYERS = 32000, 1024, 4096, 4  # 2 x 32.8M (emb, head) + 4 x 8.4M = 99.3M params


# AutoTP's rules for Big's blocks (Sequential: 0 is the up projection, 2 the down one)
TP_LAYER_SPECS = [
    {"patterns": [r".*layers\.\d+\.0\.weight$", r".*layers\.\d+\.0\.bias$"], "partition_type": "column"},
    {"patterns": [r".*layers\.\d+\.2\.weight$"], "partition_type": "row"},
]


def build_model(layers: int = LAYERS, dim: int = DIM, hidden: int = HIDDEN, experts: int = 0, ep: int = 1):
    import torch
    from torch import nn

    def block():
        mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        if not experts:
            return mlp
        from deepspeed.moe.layer import MoE

        return MoE(hidden_size=dim, expert=mlp, num_experts=experts, ep_size=ep, k=1)

    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, dim)
            self.layers = nn.ModuleList(block() for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, VOCAB, bias=False)
            self.register_buffer("step_count", torch.zeros((), dtype=torch.long))

        def forward(self, tokens, targets):
            h, aux = self.emb(tokens), 0.0
            for layer in self.layers:
                out = layer(h)
                if experts:  # MoE returns (output, load-balancing loss, expert counts)
                    out, l_aux, _ = out
                    aux = aux + l_aux
                h = h + out
            logits = self.head(self.norm(h)).float()
            with torch.no_grad():
                self.step_count += 1
            return nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1)) + 0.01 * aux

    return Big()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dim", type=int, default=DIM)
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--layers", type=int, default=LAYERS, help="more layers: a bigger model, same largest tensor")
    ap.add_argument("--zero-init", action="store_true", help="ZeRO-3: partition the params as they are created")
    ap.add_argument("--tp", type=int, default=1, help="AutoTP degree (tensor_parallel.autotp_size)")
    ap.add_argument("--experts", type=int, default=0, help="every block a MoE of this many experts")
    ap.add_argument("--ep", type=int, default=1, help="with --experts: expert-parallel degree")
    args = ap.parse_args()

    import deepspeed
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    deepspeed.init_distributed()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.stage},
    }
    if args.zero_init:
        # Adam's step makes fp32 copies of a sub-group's gradients and foreach temporaries: keep them small.
        config["zero_optimization"].update(sub_group_size=100_000_000, reduce_bucket_size=50_000_000)
    if args.tp > 1:
        config["tensor_parallel"] = {
            "autotp_size": args.tp,
            "partition_config": {"use_default_specs": False, "layer_specs": TP_LAYER_SPECS},
        }
    times, t0 = {}, time.perf_counter()

    def phase(name):
        nonlocal t0
        dist.barrier()
        times[name] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()

    if args.zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build_model(args.layers, args.dim, args.hidden)
    else:
        model = build_model(args.layers, args.dim, args.hidden, args.experts, args.ep)
    # the whole model's parameters, counted before AutoTP shards them (a rank builds only its experts)
    params = sum(p.numel() * (args.ep if "deepspeed_experts" in n else 1) for n, p in model.named_parameters())
    phase("build_model_s")
    groups = model.parameters()
    if args.experts:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(groups), "name": "params"})
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    phase("initialize_s")
    data_rank = engine.mpu.get_data_parallel_rank() if args.tp > 1 else dist.get_rank()
    g = torch.Generator().manual_seed(data_rank)
    tokens = torch.randint(0, VOCAB, (1, 16), generator=g)
    loss = engine(tokens, torch.roll(tokens, 1, 1))
    engine.backward(loss)
    engine.step()
    phase("train_step_s")
    engine.save_checkpoint(str(args.out))
    phase("save_checkpoint_s")
    if dist.get_rank() == 0:
        if args.stage == 3:
            params = sum(p.ds_numel for p in model.parameters())
        (args.out / "bench.json").write_text(
            json.dumps(
                {
                    "stage": args.stage,
                    "world_size": dist.get_world_size(),
                    "params": params,
                    "deepspeed": deepspeed.__version__,
                    "model": {"dim": args.dim, "hidden": args.hidden, "layers": args.layers, "vocab": VOCAB},
                    "tp": args.tp,
                    "experts": args.experts,
                    "ep": args.ep,
                    "deepspeed_times": times,
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One FSDP2 job loading the ~100M-parameter benchmark checkpoint: through ckptspec's DCP reader (in place) or
from a DCP copy (``ckptspec export --format dcp``). Run under torchrun by bench_dcp_reader.py:

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/fsdp2_load_big.py --reader CKPT --report R.json
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/fsdp2_load_big.py --copy DCP_DIR --report R.json

Every rank builds train_big.py's model in fp32, ``fully_shard``s each block, the embedding, the head and the
root on a CPU mesh of all ranks (gloo), makes ``torch.optim.AdamW`` and loads the way a user does
(``get_state_dict``, ``dcp.load``, ``set_state_dict``). Each rank measures the load alone: wall seconds, bytes
its process read (``rchar`` of /proc/self/io, every ``read`` whatever the page cache holds; for the reader also
its own ``bytes_read``), and peak RSS before and after. Rank 0 writes the ranks' numbers to ``--report``.
No DeepSpeed is imported (the model has no MoE).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from train_big import build_model


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--reader", type=Path, help="a DeepSpeed checkpoint, read in place")
    src.add_argument("--copy", type=Path, help="a DCP directory (ckptspec export --format dcp)")
    ap.add_argument("--report", type=Path, required=True)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model()
    for unit in [model.emb, *model.layers, model.head]:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if args.reader is not None:
        from ckptspec import DeepSpeedReader

        reader = DeepSpeedReader(str(args.reader))
        kwargs = {"storage_reader": reader}
    else:
        reader, kwargs = None, {"checkpoint_id": str(args.copy)}

    dist.barrier()
    before_rss, before_read, t0 = _peak_mib(), _rchar(), time.perf_counter()
    dcp.load(state, **kwargs)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    wall = time.perf_counter() - t0
    mine = {
        "rank": dist.get_rank(),
        "wall_s": wall,
        "rchar": _rchar() - before_read,
        "bytes_read": getattr(reader, "bytes_read", None),
        "peak_rss_before_mib": before_rss,
        "peak_rss_mib": _peak_mib(),
        # the rank's share of what the load fills: its local shards of every parameter and both moments
        "share_bytes": sum(
            t.to_local().numel() * t.element_size()
            for t in [p for p in model.parameters()]
            + [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        ),
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        args.report.write_text(json.dumps(every, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""An FSDP2 job that saves a ~100M-parameter model as a torch DCP checkpoint (bench_dcp_reconstruct.py's input).

    torchrun --nproc_per_node 2 benchmarks/fsdp2_save_big.py OUT_DIR

Eight ``Linear(3584, 3584)`` layers (102.8M fp32 parameters, 392 MiB), each and the root ``fully_shard``ed on a
CPU mesh (gloo), saved with ``dcp.save({"model": ...})`` from ``get_state_dict``. Rank 0 also writes
``OUT_DIR.full.pt``: every parameter's ``full_tensor()``, the benchmark's check of the outputs.
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

WIDTH, LAYERS = 3584, 8


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=out)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if dist.get_rank() == 0:
        torch.save(full, out + ".full.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

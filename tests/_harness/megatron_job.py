"""A Megatron-core ``torch_dist`` checkpoint saved and loaded by Megatron-core itself (issue #42, item 3).

    torchrun --nproc_per_node 2 tests/_harness/megatron_job.py OUT

Runs in ``.venv-megatron`` (``scripts/megatron.sh``: torch 2.13.0, megatron-core 0.16.1), on CPU with gloo, without
a GPT model: the state dict a GPT model's ``sharded_state_dict()`` gives, built by hand from Megatron's own
``ShardedTensor`` and ``ShardedObject`` with its key naming. Each rank is one tensor-parallel rank (ws 2):

  embedding.word_embeddings.weight                    bf16, vocab split along dim 0 (VocabParallelEmbedding)
  decoder.layers.self_attention.linear_qkv.weight     2 layers stacked on a prepended axis, split along dim 0
  decoder.layers.mlp.linear_fc2.weight                the same, split along dim 1 (a row-parallel linear)
  decoder.final_layernorm.weight                      replicated on every rank (replica_id: the rank)
  output_layer.weight                                 split along dim 0
  optimizer.state.exp_avg.output_layer.weight         an optimizer state, sharded as its parameter
  rng_state                                           a ShardedObject per rank (a bytes entry of the DCP part)
  iteration, checkpoint_version, opt_param_scheduler  common state: rank 0 saves it to common.pt

``dist_checkpointing.save(..., sharded_strategy=("torch_dist", 1))`` writes OUT/checkpoint. Then every rank loads the
whole of every tensor with ``dist_checkpointing.load`` (one ShardedTensor of the global shape per key) and rank 0
writes OUT/loaded.pt (``torch.save``: every key's tensor as Megatron loaded it, the common state and rank 0's
``rng_state``) and OUT/job.json (the versions, and the sha256 of this file: the suite reads a committed copy and
fails when this file changed since it was made). The test holds ``ckptspec reconstruct`` against loaded.pt.

Megatron's torch_dist save does not run on a CPU-only torch as shipped: its sync save calls
``torch.cuda.synchronize()`` (filesystem_async.py, ``preload_tensors``: "AssertionError: Torch not compiled with
CUDA enabled") and puts the all-ranks failure flag on ``torch.cuda.current_device()``. With no GPU there is nothing
to synchronize and the flag is a CPU tensor (gloo): the two are replaced below, nothing else. Its writer also
starts a ``spawn`` multiprocessing manager, which imports this file again: everything runs under ``__main__``.
"""

import hashlib
import json
import sys
import warnings
from pathlib import Path

LAYERS, HIDDEN, VOCAB, FFN = 2, 8, 16, 32


def tensors(torch):
    """The whole tensors, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(42)
    return {
        "embedding.word_embeddings.weight": torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16),
        "decoder.layers.self_attention.linear_qkv.weight": torch.randn(LAYERS, 3 * HIDDEN, HIDDEN, generator=g),
        "decoder.layers.mlp.linear_fc2.weight": torch.randn(LAYERS, HIDDEN, FFN, generator=g),
        "decoder.final_layernorm.weight": torch.randn(HIDDEN, generator=g),
        "output_layer.weight": torch.randn(VOCAB, HIDDEN, generator=g),
        "optimizer.state.exp_avg.output_layer.weight": torch.randn(VOCAB, HIDDEN, generator=g) * 1e-3,
    }


def sharded(whole, rank, ws):
    """This rank's sharded state dict, as a tensor-parallel GPT model's ``sharded_state_dict()`` names it."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    out = {}
    for key, t in whole.items():
        if key.startswith("decoder.layers."):  # one ShardedTensor per layer, the layer axis prepended
            axis = 0 if "linear_qkv" in key else 1
            for layer in range(LAYERS):
                local = t[layer].chunk(ws, axis)[rank].clone()
                out[f"{key}.{layer}"] = ShardedTensor.from_rank_offsets(
                    key, local, (0, layer, LAYERS), (axis + 1, rank, ws), prepend_axis_num=1
                )
        elif key == "decoder.final_layernorm.weight":
            out[key] = ShardedTensor.from_rank_offsets(key, t.clone(), replica_id=rank)
        else:
            out[key] = ShardedTensor.from_rank_offsets(key, t.chunk(ws, 0)[rank].clone(), (0, rank, ws))
    out["rng_state"] = ShardedObject("rng_state", {"seed": 1234 + rank, "tp_rank": rank}, (ws,), (rank,))
    out["iteration"] = 7
    out["checkpoint_version"] = 3.0
    out["opt_param_scheduler"] = {"max_lr": 3e-4, "num_steps": 7, "decay_style": "cosine"}
    return out


def main():
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.cuda.synchronize = lambda *args, **kwargs: None  # see the docstring: a CPU-only torch
    torch.cuda.current_device = lambda: "cpu"
    import megatron.core
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    whole = tensors(torch)
    checkpoint = out / "checkpoint"
    if rank == 0:
        checkpoint.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(sharded(whole, rank, ws), str(checkpoint), sharded_strategy=("torch_dist", 1))

    # Load back: the whole of every tensor on every rank (the rank as replica id), rank 0's rng_state.
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(t), replica_id=rank) for k, t in whole.items()}
    request["rng_state"] = ShardedObject("rng_state", None, (ws,), (rank,))
    loaded = dist_checkpointing.load(request, str(checkpoint))
    if rank == 0:
        torch.save(loaded, out / "loaded.pt")
        job = {
            "megatron_core": megatron.core.__version__,
            "torch": torch.__version__,
            "world_size": ws,
            "script_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        }
        (out / "job.json").write_text(json.dumps(job, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Megatron-style tensor-parallel layers inside a PipelineModule (the "pipe" layout with ``tp`` > 1).

DeepSpeed 0.19.8's AutoTP cannot run inside a PipelineModule (parallel_models.normalize says why), so a
tensor-parallel pipeline is what Megatron-DeepSpeed builds: its own column- and row-parallel linears over
the tensor group, in a ``PipelineModule`` given a ``PipeModelDataParallelTopology`` (DeepSpeed then takes
the module's grid as mpu and writes ``layer_XX-model_YY-model_states.pt`` per tensor rank and one ZeRO
domain per (stage, tensor rank)). Written here from the Megatron pattern, not copied:

* a column-parallel linear holds rows ``[r * n/tp, (r+1) * n/tp)`` of the whole weight and bias (split dim 0):
  forward identity on its input, its input's gradient all-reduced over the tensor group;
* a row-parallel linear holds columns ``[r * n/tp, (r+1) * n/tp)`` of the weight (split dim 1) and the whole
  bias (replicated, added after the sum): its partial outputs all-reduced, gradient identity.

Every tensor rank of a stage draws the whole layer from the same generator state and keeps its slice, so
the shards compose to one whole model. ``partition_dim`` on a parameter is its split dimension (Megatron's
attribute; None: replicated); the job gathers whole tensors with it (``gather_whole``), never from the files.

The split rules are also saved the way Megatron-DeepSpeed saves them: ``universal_checkpoint_info`` in the
client state (``UNIVERSAL_INFO``: row-parallel and tensor-replicated parameter-name patterns; every other
parameter is split along dim 0), which DeepSpeed's ds_to_universal reads.

With ``tied``, ``frozen`` and ``buffers`` (issue #40's extras): the plain pipeline's (parallel_models._pipe_layers)
TiedLayerSpec at layers 0 and 4, replicated on every tensor rank (its frozen gain and its buffer too), layer 2's
column-parallel ``up.weight`` frozen (a frozen shard per tensor rank), a persistent buffer in layer 3's block
(replicated: every tensor rank of a stage sees the same input). ``UNIVERSAL_INFO_EXTRAS`` names that model's
replicated parameters (the tie under both its stage name and its whole-model names) and frozen gain.
"""

from _harness.job.parallel_models import PIPE_FROZEN, C, H, W

# The pipeline's parameters (PipelineModule names them ``<layer>.<name>``): layers 0 and 4 plain Linear layers
# (replicated on every tensor rank), 2 and 3 tensor-parallel blocks.
UNIVERSAL_INFO = {
    "universal_checkpoint_version": 0.2,
    "parameter_with_row_parallelism_patterns": [r"^\d+\.down\.weight$"],
    "tp_replicated_parameter_patterns": [r"^\d+\.down\.bias$", r"^0\.(weight|bias)$", r"^4\.(weight|bias)$"],
    "vocabulary_parameter_patterns": [],
}
# The extras model (six layers: the tie at 0 and 4, the last Linear at 5). ds_to_universal's strict check wants each
# pattern to match a trainable parameter: the gain shares one with the tied weight, the buffers none (they are never
# in its folder; replicated on every tensor rank, as any buffer of these layers).
UNIVERSAL_INFO_EXTRAS = {
    **UNIVERSAL_INFO,
    "tp_replicated_parameter_patterns": [
        r"^\d+\.down\.bias$",
        r"^(tied_modules\.emb|0|4)\.(weight|gain)$",
        r"^5\.(weight|bias)$",
    ],
}


def universal_info(spec):
    """The ``universal_checkpoint_info`` the job saves for ``spec``'s model."""
    return UNIVERSAL_INFO_EXTRAS if spec["tied"] else UNIVERSAL_INFO


class TensorGroup:
    """The tensor-parallel group of this rank (its process group, rank in it and size)."""

    def __init__(self, group, rank, size):
        self.group, self.rank, self.size = group, rank, size


def tensor_group(topology):
    """Every rank's tensor-parallel groups of ``topology`` (collective: every rank creates each group in
    the same order, before the PipelineModule creates its grid's), and this rank's."""
    import torch.distributed as dist

    mine = None
    for ranks in topology.get_axis_comm_lists("model"):
        group = dist.new_group(ranks=ranks)
        if dist.get_rank() in ranks:
            mine = TensorGroup(group, ranks.index(dist.get_rank()), len(ranks))
    return mine


def _functions():
    import torch
    import torch.distributed as dist

    class CopyToTensorGroup(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    class ReduceFromTensorGroup(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            x = x.contiguous().clone()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    return CopyToTensorGroup, ReduceFromTensorGroup


def _split(whole, tg, dim):
    size = whole.shape[dim] // tg.size
    return whole.narrow(dim, tg.rank * size, size).clone()


def tp_block_class():
    """x + down(relu(up(x))) with ``up`` column-parallel and ``down`` row-parallel over ``tg``."""
    import torch
    from torch import nn

    copy_to, reduce_from = _functions()

    class TensorParallelBlock(nn.Module):
        def __init__(self, tg):
            super().__init__()
            self.tg = tg
            up, down = nn.Linear(W, H), nn.Linear(H, W)  # the whole layer, as a tp1 Block draws it
            self.up = nn.Linear(W, H // tg.size)
            self.down = nn.Linear(H // tg.size, W)
            with torch.no_grad():
                self.up.weight.copy_(_split(up.weight, tg, 0))
                self.up.bias.copy_(_split(up.bias, tg, 0))
                self.down.weight.copy_(_split(down.weight, tg, 1))
                self.down.bias.copy_(down.bias)
            for param, dim in ((self.up.weight, 0), (self.up.bias, 0), (self.down.weight, 1), (self.down.bias, None)):
                param.partition_dim = dim
                param.tensor_model_parallel = dim is not None

        def forward(self, x):
            h = torch.relu(self.up(copy_to.apply(x, self.tg.group)))
            partial = nn.functional.linear(h, self.down.weight)
            return x + reduce_from.apply(partial, self.tg.group) + self.down.bias

    return TensorParallelBlock


def tp_buffer_block_class():
    """The tensor-parallel block with a persistent buffer its training forward updates (parallel_models'
    BufferBlock's), the same on every tensor rank."""
    import torch

    block = tp_block_class()

    class TensorParallelBufferBlock(block):
        def __init__(self, tg):
            super().__init__(tg)
            self.register_buffer("running", torch.zeros(W))

        def forward(self, x):
            if self.training:
                with torch.no_grad():
                    self.running.mul_(0.5).add_(x.detach().float().mean(0).to(self.running.dtype), alpha=0.5)
            return super().forward(x)

    return TensorParallelBufferBlock


def tp_pipe_layers(tg, spec=None):
    """(class, args, tie key) of each pipeline layer: the plain pipeline's (parallel_models._pipe_layers) with its
    two blocks tensor-parallel; with ``tied`` its six layers (the tie replicated on every tensor rank)."""
    from torch import nn

    from _harness.job.parallel_models import _tied_class

    block = tp_block_class()
    if not (spec and spec["tied"]):
        return [(nn.Linear, (W, W), None), (nn.ReLU, (), None), (block, (tg,), None), (block, (tg,), None)] + [
            (nn.Linear, (W, C), None)
        ]
    third = tp_buffer_block_class() if spec["buffers"] else block
    tied = (_tied_class(spec["frozen"], spec["buffers"]), (), "emb")
    return [tied, (nn.ReLU, (), None), (block, (tg,), None), (third, (tg,), None), tied, (nn.Linear, (W, C), None)]


def build_tp_pipe(spec):
    """The PipelineModule over a PipeModelDataParallelTopology(pp, tp, world / (pp * tp))."""
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    dp = dist.get_world_size() // (spec["pp"] * spec["tp"])
    topology = PipeModelDataParallelTopology(num_pp=spec["pp"], num_mp=spec["tp"], num_dp=dp)
    tg = tensor_group(topology)
    model = PipelineModule(
        layers=[
            TiedLayerSpec(key, cls, *args) if key else LayerSpec(cls, *args)
            for cls, args, key in tp_pipe_layers(tg, spec)
        ],
        topology=topology,
        loss_fn=torch.nn.CrossEntropyLoss(),
        partition_method=spec["partition"],
    )
    for name, param in model.named_parameters():  # only the stage that builds layer 2 has it
        if spec["frozen"] and name == PIPE_FROZEN:
            param.requires_grad_(False)
    model.tensor_group = tg
    return model


def gather_whole(module, tensors):
    """Local name -> the whole tensor of ``tensors[name]`` (a shard of this rank's module parameter): the
    tensor group's shards concatenated along the parameter's ``partition_dim`` (collective over the tensor
    group, in the module's order); replicated ones as they are."""
    import torch
    import torch.distributed as dist

    tg = module.tensor_group
    out = {}
    for name, param in module.named_parameters():
        if name not in tensors:
            continue
        value, dim = tensors[name].contiguous(), getattr(param, "partition_dim", None)
        if dim is None:
            out[name] = value.clone()
            continue
        parts = [torch.empty_like(value) for _ in range(tg.size)]
        dist.all_gather(parts, value, group=tg.group)
        out[name] = torch.cat(parts, dim=dim)
    return out


def whole_moments(engine):
    """ "exp_avg"/"exp_avg_sq" -> local name -> the whole Adam moment (safe_get_full_optimizer_state of the
    shard, gathered as ``gather_whole``); collective."""
    from deepspeed.utils import safe_get_full_optimizer_state

    out = {}
    for key in ("exp_avg", "exp_avg_sq"):
        local = {}
        for name, param in engine.module.named_parameters():
            value = safe_get_full_optimizer_state(param, key)
            if value is not None:
                local[name] = value.detach().clone().float()
        out[key] = gather_whole(engine.module, local)
    return out

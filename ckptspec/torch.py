"""Manifests from a plain torch module (no ZeRO: stage 0, one rank).

Imports torch only through the objects it is given.
"""

from __future__ import annotations

from ._version import __version__
from .format.dtypes import dtype_name
from .format.models import Alias, Buffer, FrozenParam, Layout, Manifest, Producer
from .format.partition import ParamSpec, flat_group
from .format.version import FORMAT_NAME, FORMAT_VERSION


def manifest_from_module(module, optimizer=None) -> Manifest:
    """Describe ``module`` as a stage-0 checkpoint.

    Arguments:
        module: a ``torch.nn.Module``.
        optimizer: optional; its ``param_groups`` give the groups and their order.
            Without it, all trainable parameters form one group in module order.

    Returns:
        A manifest with one flat group per optimizer param group, frozen parameters
        (``requires_grad=False``), persistent buffers and aliases found by tensor
        identity. It lists no files.
    """
    import torch

    named = list(module.named_parameters(remove_duplicate=False))
    owner_of: dict[int, str] = {}
    aliases = []
    for name, param in named:
        if id(param) in owner_of:
            aliases.append(Alias(name=name, owner=owner_of[id(param)], shape=list(param.shape)))
        else:
            owner_of[id(param)] = name

    if optimizer is not None:
        ordered = [[p for p in group["params"] if p.requires_grad] for group in optimizer.param_groups]
    else:
        ordered = [[p for _, p in module.named_parameters() if p.requires_grad]]
    groups = []
    for i, params in enumerate(ordered):
        specs = [ParamSpec(owner_of[id(p)], tuple(p.shape), dtype_name(p.dtype)) for p in params]
        groups.append(flat_group(specs, optimizer_group=i, partition_count=1, zero_stage=0))
    trainable = {id(p) for params in ordered for p in params}

    frozen = [
        FrozenParam(name=name, shape=list(p.shape), numel=p.numel(), dtype=dtype_name(p.dtype), stored_in="module")
        for name, p in module.named_parameters()
        if id(p) not in trainable
    ]
    persistent = module.state_dict(keep_vars=True).keys()
    buffers = [
        Buffer(name=name, shape=list(b.shape), dtype=dtype_name(b.dtype))
        for name, b in module.named_buffers()
        if name in persistent
    ]
    first = next((p for _, p in named), None)
    dtype = dtype_name(first.dtype) if first is not None else "float32"
    layout = Layout(
        zero_stage=0,
        world_size=1,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        model_dtype=dtype,
        master_dtype=dtype,
        round_robin=False,
        parameter_alignment=False,
        tail_padding_saved=False,
    )
    if optimizer is not None:
        layout.optimizer = type(optimizer).__name__
    return Manifest(
        format=FORMAT_NAME,
        format_version=FORMAT_VERSION,
        producer=Producer(
            tool="ckptspec", tool_version=__version__, framework="torch", framework_version=torch.__version__
        ),
        layout=layout,
        groups=groups,
        frozen=frozen,
        buffers=buffers,
        aliases=aliases,
        excluded=[],
        files=[],
    )

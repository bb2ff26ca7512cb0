"""Megatron-core ``torch_dist`` checkpoints: a DCP directory with Megatron's ``metadata.json`` and ``common.pt``.

``megatron.core.dist_checkpointing.save(..., sharded_strategy=("torch_dist", 1))`` writes, in one directory:

- the DCP part (``.metadata``, ``__R_N.distcp``): every ``ShardedTensor`` under its key (``decoder.layers.mlp.
  linear_fc2.weight``: a model's layers stacked on a leading axis), each ``ShardedObject`` as bytes entries
  ``<key>/shard_<offsets>_<shape>``; its ``.metadata`` also holds ``all_local_plans`` (``standins``);
- ``metadata.json``: the backends (``{"sharded_backend": "torch_dist", ..., "common_backend": "torch"}``), read
  here as JSON under a size cap (an object without ``sharded_backend`` is another tool's: the save is a plain DCP one);
- ``common.pt``: the state that is no sharded tensor (the iteration, the scheduler's state, ``args``), a
  ``torch.save`` rank 0 wrote, which Megatron's load unpickles unrestricted. Read here by the restricted ``.pt``
  reader (``torchfile``): a global off its allowlist is refused by name (CK204), never called.

Standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import FileUnreadable, TorchFileError, UnsupportedCheckpoint
from ...location import RemotePath, open_binary
from ..torchfile import read_pt_metadata

Where = Path | RemotePath  # the checkpoint's directory: local, or at a URL

CONFIG_NAME = "metadata.json"
COMMON_NAME = "common.pt"
CONFIG_CAP = 64 * 1024  # Megatron writes ~120 bytes
OPTIMIZER_PREFIX = "optimizer."  # the optimizer's sharded state: optimizer.state.<state>.<parameter key>, ...


@dataclass(frozen=True)
class MegatronParts:
    """What a torch_dist checkpoint holds beside its DCP part."""

    config: dict[str, Any]  # metadata.json
    common: dict[str, Any] | None  # common.pt's tree (tensors as ``TensorRef``), None when it is missing


def is_megatron_dir(path: Where) -> bool:
    """A DCP directory Megatron-core may have saved: it holds ``metadata.json`` (``read_megatron`` tells)."""
    return (path / CONFIG_NAME).is_file()


def read_config(directory: Where) -> dict[str, Any] | None:
    """``metadata.json``, checked: a JSON object of at most ``CONFIG_CAP`` bytes naming the torch_dist backend; None
    for an object without ``sharded_backend`` (another tool's file beside a plain DCP save: not Megatron's)."""
    path = directory / CONFIG_NAME
    try:
        with open_binary(path) as fh:  # a URL too: one range request of at most the cap
            data = fh.read(CONFIG_CAP + 1)
    except OSError as exc:
        raise FileUnreadable(path, exc) from None
    if len(data) > CONFIG_CAP:
        raise TorchFileError(path, f"{CONFIG_NAME} holds over {CONFIG_CAP} bytes, not Megatron's backend config")
    try:
        config = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise TorchFileError(path, f"{CONFIG_NAME} is not JSON: {exc}") from None
    if type(config) is not dict:
        raise TorchFileError(path, f"{CONFIG_NAME} holds a {type(config).__name__}, not Megatron's backend config")
    if "sharded_backend" not in config:
        return None
    backend = config.get("sharded_backend")
    if backend != "torch_dist" or config.get("common_backend", "torch") != "torch":
        raise UnsupportedCheckpoint(
            f"Megatron sharded backend {backend!r:.40} with common backend {config.get('common_backend')!r:.40}: "
            "only torch_dist (with torch) is read",
            "save with sharded_strategy=('torch_dist', 1), or convert the checkpoint with Megatron first",
            str(path),
        )
    return config


def read_common(directory: Where) -> dict[str, Any] | None:
    """``common.pt`` read by the restricted reader (None when it is missing): a dict, as Megatron saves it."""
    path = directory / COMMON_NAME
    if not path.is_file():
        return None
    tree = read_pt_metadata(path)
    if not isinstance(tree, dict):
        raise TorchFileError(path, f"{COMMON_NAME} holds a {type(tree).__name__}, not Megatron's common state dict")
    return tree


def read_megatron(directory: Where) -> MegatronParts | None:
    """The parts beside the DCP part (None: ``metadata.json`` is not Megatron's); raises a ``CkptspecError`` (CK202,
    CK204, CK205, CK225, CK901)."""
    config = read_config(directory)
    return None if config is None else MegatronParts(config, read_common(directory))


def is_model_key(fqn: str) -> bool:
    """A model tensor: Megatron names the optimizer's sharded state under ``optimizer.``, the model's without."""
    return not fqn.startswith(OPTIMIZER_PREFIX)


def describe(value: Any, depth: int = 0) -> Any:
    """A common state value as plain JSON: scalars as they are, a tensor by dtype and shape, containers to a depth
    of 3 (deeper: the type's name)."""
    from .. import standins

    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, standins.TensorRef):
        return {"tensor": value.storage.dtype, "shape": list(value.shape)}
    if depth >= 3:
        return type(value).__name__
    if isinstance(value, dict):
        return {str(k): describe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v, depth + 1) for v in value]
    return type(value).__name__

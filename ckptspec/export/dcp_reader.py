"""A DeepSpeed checkpoint read in place by torch's Distributed Checkpoint: ``DeepSpeedReader``, a DCP
``StorageReader``. No copy: ``dcp.load(state_dict, storage_reader=DeepSpeedReader(CHECKPOINT))``.

The checkpoint *is* the DCP checkpoint of its export (``export --format dcp``, ``dcp.py``): the same keys
(``plan_dcp``: what ``get_state_dict(model, optimizer)`` gives for the consolidated model), each tensor one
whole chunk, so DCP's planner asks each rank for the box of each tensor its shard holds, and the reader reads
the byte ranges of that box only (``dcp_source.box_segments``), into the tensor the planner gives (cast to
its dtype). ``param_groups`` are bytes items: ``torch.save`` of the plan's own plain values (nothing of the
checkpoint is unpickled); each ``step`` is a 0-d float32 tensor made from the document.

Validated once: in a job where ``torch.distributed`` is initialized, rank 0 of the group validates and every
rank plans from its verdict (``dcp_source``), so a checkpoint with an error fails every rank with the same
finding in ``read_metadata``, before any tensor is read. A local checkpoint's recorded file hashes are
checked by that validation (it hashes the files, as ``ckptspec.open`` does); a tensor's recorded digest is
checked when a read takes the whole tensor; a remote file's recorded hash is not (it would fetch the whole
file: what the reader is there to avoid).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..deepspeed.load.verdict import on_rank_0
from ..errors import CkptspecError
from ..format.dtypes import ITEMSIZE
from .arrays import ShardReader, check_digest
from .dcp import DcpPlan, _state_dict
from .dcp_source import box_segments, planned, validated, whole
from .model_plan import TensorSource

KeyMap = Callable[[str], "str | Sequence[str] | None"]


class DeepSpeedReader(StorageReader):
    """A DeepSpeed checkpoint of any kind (``ckptspec.open``'s: ZeRO 1/2/3, tensor/pipeline parallel, MoE,
    stage 0; a directory or a URL) as a DCP checkpoint, read in place.

    ``manifest``, ``tag``: as ``ckptspec.open``'s. ``key_map``: our key (``model.<name>``,
    ``optim.state.<param>.<state>``, ``optim.param_groups.<i>.<key>``) -> the loading job's key, None to
    leave it out, or a list of keys that each take its value (torchtitan keys a group's hyperparameters per
    parameter: ``optimizer.param_groups.<param>.<key>``); without it, the keys are those of
    ``get_state_dict(model, optimizer)`` saved as ``{"model": ..., "optim": ...}``. ``process_group``: the
    group ``dcp.load`` runs on; ``collective``: validate on its rank 0 and broadcast the verdict (default: when
    ``torch.distributed`` is initialized; pass False for a ``dcp.load(..., no_dist=True)`` on some ranks only).
    ``bytes_read``: the checkpoint bytes this reader read for tensors (this process's); ``validated_here``:
    whether this process validated the checkpoint (rank 0 of the group, or a process on its own) rather than
    received the verdict.
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike | None = None,
        *,
        manifest: Any = None,
        tag: str | None = None,
        key_map: KeyMap | None = None,
        process_group: Any = None,
        collective: bool | None = None,
    ):
        super().__init__()
        self.checkpoint_id = checkpoint
        self.manifest, self.tag, self.key_map = manifest, tag, key_map
        self.process_group, self.collective = process_group, collective
        self.bytes_read = 0
        self.validated_here = False
        self._plan: DcpPlan | None = None
        self._metadata: Metadata | None = None
        self._keys: dict[str, str] = {}  # the loading job's key -> ours
        self._values: dict[str, Any] = {}  # ours -> a param_groups value (bytes items)
        self._owner: dict[str, str] = {}  # ours -> the first of our keys with the same tensor (a tie's owner)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and checkpoint_id != self.checkpoint_id:
            self.checkpoint_id, self._plan, self._metadata = checkpoint_id, None, None
        self.bytes_read = 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether ``checkpoint_id`` is a DeepSpeed save or tag directory (``latest``, or states files)."""
        from ..deepspeed.layout.tag_dir import resolve_tag_dir

        try:
            resolve_tag_dir(checkpoint_id)
        except (CkptspecError, OSError, ValueError):
            return False
        return True

    @property
    def _remote(self) -> bool:
        from ..location import is_remote

        return is_remote(self.checkpoint_id)

    def read_metadata(self) -> Metadata:
        if self._metadata is None:
            self._plan = self._open()
            first: dict[int, str] = {}
            self._owner = {key: first.setdefault(id(s), key) for key, s in self._plan.tensors.items()}
            self._metadata = self._build_metadata(self._plan)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        self.read_metadata()  # a reader given metadata it did not read: plan the checkpoint (validated once)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        dcp_plan = self._plan
        assert dcp_plan is not None, "read_metadata first"
        # A tied alias is its owner's tensor under another key: each box is read once, then copied to the others.
        boxes: dict[tuple, list] = {}  # (owner key, offsets, lengths) -> [source, offsets, lengths, items taking it]
        for item in plan.items:
            if (box := self._box(item)) is not None:
                boxes.setdefault(box, [dcp_plan.tensors[box[0]], item.storage_offsets, item.lengths, 0])[3] += 1
        held: dict[tuple, torch.Tensor] = {}  # a box read for an item, until the last item taking it
        with ShardReader() as files:
            if self._remote:  # a remote file's ranges are fetched ahead, in the order they are read
                files.plan(
                    seg
                    for source, offsets, lengths, _ in boxes.values()
                    for seg in box_segments(source, offsets, lengths)
                )
            for item in plan.items:
                key = self._keys[item.storage_index.fqn]
                if item.type == LoadItemType.BYTE_IO:
                    value = io.BytesIO()
                    torch.save(self._values[key], value)  # our own plain value: a float, a tuple, names
                    value.seek(0)
                    planner.load_bytes(item, value)
                    continue
                target = planner.resolve_tensor(item).detach()
                box = self._box(item)
                if box is None:  # a step
                    target.copy_(torch.tensor(dcp_plan.steps[key], dtype=torch.float32))
                elif box in held:
                    target.copy_(held[box])
                else:
                    source, offsets, lengths, _ = boxes[box]
                    held[box] = self._read_box(source, offsets, lengths, files, target)
                if box is not None:
                    boxes[box][3] -= 1
                    if boxes[box][3] == 0:
                        held.pop(box, None)
                planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _box(self, item) -> tuple | None:
        """What a tensor item reads: (the key of its source in the plan, offsets, lengths); None for a step
        or a bytes item. A tied alias's key names its owner's source, so both take one box."""
        assert self._plan is not None
        key = self._keys[item.storage_index.fqn]
        if item.type == LoadItemType.BYTE_IO or key in self._plan.steps:
            return None
        return self._owner.get(key, key), tuple(item.storage_offsets), tuple(item.lengths)

    def _read_box(
        self, source: TensorSource, offsets, lengths, files: ShardReader, target: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The box of ``source`` from its byte ranges only: into ``target`` (cast to its dtype), read there
        directly when it is a contiguous CPU tensor of the stored dtype, else through a buffer of it."""
        dtype = getattr(torch, source.dtype)
        direct = target is not None and target.dtype == dtype and target.device.type == "cpu" and target.is_contiguous()
        box = target if direct else torch.empty(tuple(lengths), dtype=dtype)
        assert box is not None and tuple(box.shape) == tuple(lengths), (source.name, lengths)
        raw = memoryview(box.reshape(-1).view(torch.uint8).numpy())
        pos = 0
        for seg in box_segments(source, offsets, lengths):
            files.read_into(seg, raw[pos : pos + seg.nbytes])
            pos += seg.nbytes
        assert pos == box.numel() * ITEMSIZE[source.dtype], (source.name, pos)
        self.bytes_read += pos
        if source.digest is not None and whole(source.shape, offsets, lengths):
            check_digest(source, hashlib.sha256(raw))  # CK222
        if target is not None and not direct:
            target.copy_(box)
        return box

    def _open(self) -> DcpPlan:
        """The DCP plan of the checkpoint, validated once: here, or on rank 0 of the group (every rank then
        raises its error, with its findings, or plans from the document it validated)."""
        if self.checkpoint_id is None:
            raise ValueError("DeepSpeedReader needs a checkpoint: DeepSpeedReader(PATH), or dcp.load(checkpoint_id=)")
        checkpoint = self.checkpoint_id
        collective = self.collective
        if collective is None:
            collective = dist.is_available() and dist.is_initialized()
        if not collective:
            self.validated_here = True
            return validated(checkpoint, self.manifest, self.tag)[1]
        group = self.process_group
        self.validated_here = dist.get_rank(group) == 0
        dcp_plan, verdict = on_rank_0(
            lambda: validated(checkpoint, self.manifest, self.tag)[1:], group, str(checkpoint)
        )
        return dcp_plan if dcp_plan is not None else planned(checkpoint, verdict)[1]

    def _build_metadata(self, dcp_plan: DcpPlan) -> Metadata:
        """DCP's metadata of the plan: every tensor one whole chunk, every param_groups value a bytes item,
        flattened as ``dcp.load`` flattens the loading job's state dict."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        flat, paths = flatten_state_dict(_state_dict(torch, dcp_plan))
        entries: dict[str, Any] = {}
        storage: dict[MetadataIndex, str] = {}
        planner_data: dict[str, Any] = {}
        self._keys, self._values = {}, {}
        for key, value in flat.items():
            for name in self._names(key):
                if name in self._keys:
                    raise ValueError(f"key_map gives {name!r} to both {self._keys[name]!r} and {key!r}")
                self._keys[name] = key
                planner_data[name] = paths[key] if name == key else tuple(name.split("."))
                if isinstance(value, torch.Tensor):
                    chunk = ChunkStorageMetadata(torch.Size([0] * value.dim()), value.size())
                    entries[name] = TensorStorageMetadata(TensorProperties(dtype=value.dtype), value.size(), [chunk])
                    storage[MetadataIndex(name, chunk.offsets)] = key
                else:
                    self._values[key] = value
                    entries[name] = BytesStorageMetadata()
                    storage[MetadataIndex(name)] = key
        return Metadata(state_dict_metadata=entries, planner_data=planner_data, storage_data=storage)

    def _names(self, key: str) -> list[str]:
        """The loading job's keys for our ``key``: several take one value when ``key_map`` gives a list (a
        tensor's boxes are still read once, as a tie's)."""
        if self.key_map is None:
            return [key]
        names = self.key_map(key)
        if names is None:
            return []
        return [names] if isinstance(names, str) else list(names)

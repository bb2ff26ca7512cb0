"""What an output directory already holds: earlier ``reconstruct`` outputs, and files that are not.

A reconstruction writes ``model.safetensors`` or ``pytorch_model.bin``, or Hugging Face shards
(``model-00001-of-00003.safetensors``, ``pytorch_model-00001-of-00003.bin``) and their index, and
with ``--optimizer-state`` ``optimizer.safetensors``. A
file of one of those names is **ckptspec's** only when its content says so: a safetensors file or
an index whose metadata has ``ckptspec.*`` keys, or a torch shard such an index lists. Those are
replaced or removed by the next run (whatever format it writes, so loaders never find stale
weights of the other format beside the new ones); any other file of those names is someone else's
and is never touched (``ForeignOutput``, CK909).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.embedded import read_safetensors_metadata
from ..checkpoint.output_names import OUTPUT_NAME
from ..errors import CkptspecError
from ..location import RemotePath

_MAX_INDEX_BYTES = 256 * 1024 * 1024  # an index holds names and one manifest


@dataclass
class ExistingOutputs:
    ours: set[str] = field(default_factory=set)  # earlier ckptspec outputs, either format
    foreign: list[str] = field(default_factory=list)  # output names ckptspec did not write


def _is_ours(meta: object) -> bool:
    return isinstance(meta, dict) and any(isinstance(k, str) and k.startswith("ckptspec.") for k in meta)


def _read_index(path: Path | RemotePath) -> dict | None:
    try:
        if path.stat().st_size > _MAX_INDEX_BYTES:
            return None
        doc = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def existing_outputs(out: Path | RemotePath) -> ExistingOutputs:
    """Sort the files of ``out`` (a directory, or a URL's prefix) that carry an output's name into ckptspec's and
    others'."""
    listed = out.iterdir() if out.is_dir() else iter(())  # a URL with no object yet is no directory
    names = sorted(p.name for p in listed if OUTPUT_NAME.match(p.name) and p.is_file())
    found = ExistingOutputs()
    for name in (n for n in names if n.endswith(".index.json")):
        index = _read_index(out / name)
        if index is not None and _is_ours(index.get("metadata")):
            found.ours.add(name)
            weight_map = index.get("weight_map")
            if isinstance(weight_map, dict):
                found.ours |= {f for f in weight_map.values() if isinstance(f, str) and f in names}
    for name in (n for n in names if n.endswith(".safetensors") and n not in found.ours):
        try:
            meta = read_safetensors_metadata(out / name)
        except CkptspecError:
            continue
        if _is_ours(meta):
            found.ours.add(name)
    found.foreign = [n for n in names if n not in found.ours]
    return found

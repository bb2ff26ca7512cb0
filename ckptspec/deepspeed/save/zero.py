"""The save hook of a plain ZeRO engine (stage 1-3, one model-parallel rank): a format 1.x manifest.

``protocol.py``'s steps: (1) the layout from the live engine (``manifest_from_engine``) and a save id
from rank 0; (2) the layout goes into the client state, so it is inside the model-states files;
(3) DeepSpeed's save into the temporary tag; (4) each rank describes its own files, from the model
states it handed ``torch.save`` where they check out; (5) rank 0 adds the tensor digests and the
others record them; (6) rank 0 validates the manifest and publishes.
"""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path

from ...checkpoint.embedded import CLIENT_STATE_KEY, client_state_value
from ...checkpoint.states import StateCache
from ...format.models import Manifest, ShardFile
from ...format.validate import validate_manifest
from ..describe.digests import add_digests, record_digests
from ..describe.zero import describe_files
from ..layout.names import file_order
from ..layout.tag_dir import ShardSet, scan_tag_dir
from ..live.zero import manifest_from_engine
from .captured_state import SavedStates
from .protocol import describe_own_files, publish_and_broadcast, save_request, save_staged


def save_zero_checkpoint(
    engine, save_dir, tag, client_state, hash, save_latest, exclude_frozen_parameters, sidecar_encoding
) -> Manifest:
    """``save_checkpoint`` of a plain ZeRO engine; returns the complete manifest (every rank)."""
    import torch.distributed as dist

    layout = manifest_from_engine(engine, exclude_frozen_parameters=exclude_frozen_parameters)
    layout.save.id = _from_rank_0(dist, str(uuid.uuid4()))  # the save id every file's copy carries
    state, tag = save_request(engine, client_state, tag)
    state[CLIENT_STATE_KEY] = client_state_value(layout)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    captured: dict = {}  # the model states DeepSpeed handed torch.save: described without reading them back
    staged = save_staged(engine, dist, save_dir, tag, state, exclude_frozen_parameters, captured)

    def own_files() -> list[dict]:
        try:
            return _describe_own_files(staged, rank, layout, "sha256" if hash else None, captured)
        finally:
            captured.clear()

    gathered = describe_own_files(dist, staged, own_files)
    # Shallow: only ``files`` changes, and the layout is not used again (a deep copy costs per param).
    complete = layout.model_copy()
    gathered_files = [ShardFile.model_validate(d) for files in gathered for d in files]
    complete.files = sorted(gathered_files, key=lambda f: file_order(f.role, f.ranks, f.path))
    if hash:
        complete = _with_digests(complete, staged, rank, dist)
    checked = lambda: _checked_document(complete)  # noqa: E731
    publish_and_broadcast(dist, staged, save_dir, tag, checked, sidecar_encoding, save_latest, what="manifest")
    return complete


def _checked_document(manifest: Manifest) -> tuple[dict, object]:
    """The sidecar's document and its validation report, from one dump (a model's dump holds plain
    ints: validate_manifest checks it as it is, without building the models again)."""
    doc = manifest.to_dict()
    return doc, validate_manifest(manifest, doc)


def _from_rank_0(dist, value):
    """Rank 0's ``value`` on every rank (a broadcast when running distributed)."""
    if dist.is_available() and dist.is_initialized():
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _with_digests(manifest: Manifest, tag_dir: Path, rank: int, dist) -> Manifest:
    """The manifest with every tensor's digest, computed by rank 0 and the same on every rank.

    A digest spans the files of several ranks, so rank 0 reads them all: when it cannot see
    every file (no shared filesystem), the manifest keeps the files' own hashes only. Rank 0
    digests ``manifest`` itself (the caller's fresh copy); the others record the digests it
    sends (only those: rebuilding the whole manifest from a broadcast took seconds at 100k).
    """
    found, error = None, None
    if rank == 0:
        try:
            if _sees_every_file(tag_dir, manifest):
                found = add_digests(manifest, tag_dir)
            else:
                warnings.warn("ckptspec: rank 0 cannot see every saved file; no tensor digests", stacklevel=3)
        except Exception as exc:  # raised on every rank below, never left hanging in the broadcast
            error = f"rank 0: {type(exc).__name__}: {exc}"
    found, error = _from_rank_0(dist, (found, error))
    if error:
        raise RuntimeError("ckptspec could not digest the saved tensors (no sidecar written): " + error)
    if rank != 0 and found:
        record_digests(manifest, found)
    return manifest


def _sees_every_file(tag_dir: Path, manifest: Manifest) -> bool:
    return all((tag_dir / f.path).is_file() for f in manifest.files)


def _describe_own_files(
    tag_dir: Path, rank: int, layout: Manifest, hash_algorithm: str | None, captured: dict | None = None
) -> list[dict]:
    """This rank's files of the tag directory (rank 0 also takes the rank-less ones), described;
    ``captured`` model states from their live state where they check out (save/captured_state.py)."""
    every = scan_tag_dir(tag_dir)
    own = ShardSet(tag_dir)
    own.model_files = {r: p for r, p in every.model_files.items() if r == rank}
    own.optim_files = {r: p for r, p in every.optim_files.items() if r == rank}
    own.other_files = list(every.other_files) if rank == 0 else []
    states = SavedStates(captured) if captured else StateCache()
    described = describe_files(own, layout.layout.zero_stage, hash_algorithm, states, layout)
    return [f.model_dump(mode="json", exclude_unset=True) for f in described]

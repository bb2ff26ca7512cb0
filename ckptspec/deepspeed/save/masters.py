"""The index and the save hook of a live ZeRO stage-0, native MoE or stage-0 pipeline engine (issue #17).

``save_masters_checkpoint``: the
refusals first, DeepSpeed's save into a temporary tag (``protocol``), then rank 0 locates the
masters the engine named in the saved files (``live.masters.resolve``), assembles the index with
the directory producers' domains, records what only the engine knows (``topology.ranks``, each
domain's ``members``, ``degrees_source: engine``), validates it, writes it as the sidecar and
publishes the tag and ``latest``. Every rank returns rank 0's index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...checkpoint.states import StateCache
from ...format.index_models import (
    CheckpointIndex,
)
from ...format.index_validate import validate_index
from ..live.masters import gather_described
from ..live.masters_index import with_engine_view
from .protocol import publish_and_broadcast, save_request, save_staged

if TYPE_CHECKING:
    from ...format.codec import Encoding


def index_of_saved(described: list[dict], folder, hash_algorithm: str | None) -> CheckpointIndex:
    """The complete index of the saved ``folder``: the engine's masters located in its files."""
    from ..describe import moe, pipeline_stage0, stage0
    from ..live.masters import resolve

    states = StateCache()
    live = resolve(described, folder, states)
    build = {"stage0": stage0.describe, "moe": moe.describe, "pipeline_stage0": pipeline_stage0.describe}
    index = build[described[0]["kind"]](folder, states, hash_algorithm, live)
    return with_engine_view(index, described)


def save_masters_checkpoint(
    engine,
    save_dir,
    tag=None,
    client_state=None,
    hash=True,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    sidecar_encoding: Encoding = "json",
) -> CheckpointIndex:
    """``save_checkpoint`` of a stage-0, MoE or stage-0 pipeline engine; returns the index (every rank)."""
    import torch.distributed as dist

    described = gather_described(engine, dist, client_state)  # refusals first, raised on every rank
    state, tag = save_request(engine, client_state, tag)
    staged = save_staged(engine, dist, save_dir, tag, state, exclude_frozen_parameters)
    box: list[Any] = [None]  # the document rank 0 publishes, shared with every rank

    def describe():
        index = index_of_saved(described, staged, "sha256" if hash else None)
        box[0] = index.to_dict()
        return box[0], validate_index(index)

    args = (describe, sidecar_encoding, save_latest)
    complete = publish_and_broadcast(dist, staged, save_dir, tag, *args, what="checkpoint index", shared=lambda: box[0])
    return CheckpointIndex.model_validate(complete)

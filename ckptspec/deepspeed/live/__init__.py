"""Live: a DeepSpeed engine in memory -> the document that describes it. The only modules (with ``save``)
that import torch and DeepSpeed, and only inside the functions that need them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...format.index_models import CheckpointIndex


def index_from_engine(
    engine, *, exclude_frozen_parameters: bool = False, client_state: dict | None = None
) -> CheckpointIndex:
    """The index of ``engine``'s checkpoint layout, without files (collective: call on every rank).

    ``client_state``: the one its save hands DeepSpeed; a tensor x pipeline-parallel engine's split rules are its
    ``universal_checkpoint_info`` (Megatron-DeepSpeed's pattern lists), as the saved model states hold them.

    ZeRO stage 0, MoE and the stage-0 pipeline get their domains and parameters without ``masters``
    (``masters_index.live_index``): a master's locator is a byte range of a saved file.

    Raises:
        UnsupportedEngine: under AutoTP a parameter (frozen ones too) partitioned without an affine map,
            a tie of a weight AutoTP splits; in a pipeline a tie inside one stage, frozen parameters at
            ZeRO-2; a tensor x pipeline-parallel engine without its split rules in ``client_state``; MoE or stage 0
            combined with tensor parallelism (but a bf16 stage-0 pipeline's), MoE with FP16_Optimizer's flat masters.
        EngineLayoutMismatch: the ranks of one coordinate describe their group differently.
    """
    from ..kinds import kind_of_engine
    from .masters import gather_described

    if kind_of_engine(engine).masters_kind is not None:  # ZeRO stage 0, MoE, the stage-0 pipeline (issue #17)
        import torch.distributed as dist

        from .masters_index import live_index

        return live_index(gather_described(engine, dist, client_state))
    from .gather import gather
    from .model_parallel import assemble, local_description

    return assemble(gather(local_description(engine, exclude_frozen_parameters, client_state)))

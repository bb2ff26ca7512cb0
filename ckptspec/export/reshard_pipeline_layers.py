"""The layers of a PipelineModule checkpoint as ``reshard --pipeline-parallel`` moves them between stages.

A layer file (``layer_XX-model_states.pt``, named by the global layer index whatever the stage) holds its
layer's state dict: trainable parameters, frozen parameters, persistent buffers, or a ``TiedLayerSpec``'s
module (DeepSpeed's ``PipelineModule`` builds that module once on each stage running one of its layers, trains
it there, and saves a copy in each of those layers' files). The files carry over as saved; what depends on the
stages is DeepSpeed's, for any set of layers (``PipelineLayers``), and each source stage must follow it (CK410):

* a stage's optimizer order is its module's ``parameters()``: the tied modules first (``PipelineModule``
  registers ``tied_modules`` before its layers; by their first layer on the stage), then the layers' own
  parameters in layer order (within a layer, as the source orders them);
* its ``buffer_names`` (``engine._get_buffer_names``, the module's ``named_buffers``): its tied modules'
  persistent buffers first (``tied_modules.<key>.<buffer>``, once however many of its layers the stage runs),
  then each layer's own, in layer order, as the layer file keys them;
* a tied module's frozen parameters and buffers are not synchronized between stages (``PipelineModule`` broadcasts
  the tied weights alone): each of its layer files keeps its stage's copy, carried over as saved. A stage running
  several of its layers loads their files into its one module in layer order (``load_state_dir``), so it holds the
  last one's, as a job at that layout does after loading;
* partition method "parameters" (``_count_layer_params``) weighs each layer by its trainable parameters, a tied
  module's at each of its layers. It builds each layer anew to count, so a parameter frozen after the model was
  built counts, one frozen in its layer's constructor does not: the files cannot tell which, so a move whose
  stages depend on it is refused.

The copies of a tied module's master and moments on the source's stages must be equal (CK401): each target stage
that runs the tie gets them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.states import StateCache
from ..deepspeed.describe.pipeline_params import TIED_PREFIX
from ..errors import ReconstructMismatch, ReshardUnsupported
from ..format.index_models import CheckpointIndex
from ..format.models import Param
from .arrays import ShardReader, read_array
from .optimizer_state import plan_optimizer_state
from .reshard_layout import natural_groups

RESUME = "resume at the same pipeline degree"


@dataclass(frozen=True)
class PipelineLayers:
    tensors: dict[int, dict[str, str]]  # layer -> its file's key -> the source stage's local name
    trainable: list[tuple[int, Param]]  # (optimizer group, manifest param) in the source's order, a tie once
    extras: dict[str, tuple[str, int]]  # "<layer>.<key>" -> (role: "frozen" | "buffer", numel)

    def order(self, layers) -> list[tuple[int, Param]]:
        """A stage's trainable parameters in its optimizer order (the module docstring)."""
        names = [n for layer in layers for n in self.tensors[layer].values()]
        ties = dict.fromkeys(n.split(".", 2)[1] for n in names if n.startswith(TIED_PREFIX))
        tied = [(g, p) for key in ties for g, p in self.trainable if p.name.startswith(f"{TIED_PREFIX}{key}.")]
        held = set(names)
        own = [(g, p) for g, p in self.trainable if p.name in held and not p.name.startswith(TIED_PREFIX)]
        return tied + sorted(own, key=lambda gp: int(gp[1].name.split(".", 1)[0]))

    def buffer_names(self, layers) -> list[str]:
        """A stage's ``buffer_names``: its module's buffers by their local names, its tied modules' first (once)."""
        names = [n for layer in layers for key, n in self.tensors[layer].items() if self._role(layer, key) == "buffer"]
        tied = [n for n in names if n.startswith(TIED_PREFIX)]
        return list(dict.fromkeys(tied)) + [n for n in names if not n.startswith(TIED_PREFIX)]

    def weights(self, count_frozen: bool) -> list[int]:
        """Each layer's weight for partition method "parameters" (``count_frozen``: its frozen parameters too)."""
        numel = {p.name: p.numel for _, p in self.trainable}
        counted = {"frozen"} if count_frozen else set()
        out = []
        for layer in range(len(self.tensors)):
            extras = [self.extras.get(f"{layer}.{key}", (None, 0)) for key in self.tensors[layer]]
            own = sum(numel.get(name, 0) for name in self.tensors[layer].values())
            out.append(own + sum(n for role, n in extras if role in counted))
        return out

    @property
    def frozen(self) -> list[str]:
        return [name for name, (role, _) in self.extras.items() if role == "frozen"]

    def _role(self, layer: int, key: str) -> str | None:
        return self.extras.get(f"{layer}.{key}", (None, 0))[0]


def pipeline_layers(index: CheckpointIndex) -> PipelineLayers:
    """The layers of ``index``'s pipeline (CK410 for a tensor the rules above do not place)."""
    domains = sorted(index.domains, key=lambda d: d.coordinate.pipeline or 0)
    trainable: dict[str, tuple[int, Param]] = {}
    for d in domains:
        for g, params in natural_groups(d.manifest):
            for p in params:
                trainable.setdefault(p.name, (g, p))
    extras: dict[str, tuple[str, int]] = {}
    for extra in index.extras or ():
        if len(extra.shards) != 1 or extra.shards[0].layer_file is None:
            raise ReshardUnsupported(
                f"--pipeline-parallel: the {extra.role} {extra.name!r} is not in one layer file", RESUME
            )
        extras[extra.name] = (extra.role, math.prod(extra.shape))
    tensors = {f.layer: dict(f.tensors) for f in index.layer_files}
    for layer, keys in sorted(tensors.items()):
        for key, name in keys.items():
            if name not in trainable and f"{layer}.{key}" not in extras:
                raise ReshardUnsupported(
                    f"--pipeline-parallel: {key!r} of layer {layer} is neither a trainable parameter, a frozen "
                    "parameter nor a buffer the checkpoint index places",
                    RESUME,
                )
    placed = {n for keys in tensors.values() for n in keys.values()}
    unplaced = sorted(set(trainable) - placed)
    if unplaced:
        raise ReshardUnsupported(f"--pipeline-parallel: parameter {unplaced[0]!r} is in no layer file", RESUME)
    return PipelineLayers(tensors, list(trainable.values()), extras)


def check_source_stages(layers: PipelineLayers, index: CheckpointIndex, states: StateCache, src_dir: Path) -> None:
    """Each source stage's optimizer order and ``buffer_names`` are the rules' for its layers (CK410 otherwise:
    the target's would be guessed)."""
    for d in index.domains:
        held = sorted(f.layer for f in index.layer_files if f.pipeline == d.coordinate.pipeline)
        expected: dict[int, list[str]] = {}
        for g, p in layers.order(held):
            expected.setdefault(g, []).append(p.name)
        saved = {g: [p.name for p in params] for g, params in natural_groups(d.manifest)}
        if saved != expected:
            raise ReshardUnsupported(
                f"--pipeline-parallel: stage {d.id}'s optimizer order {saved} is not its module's parameter order "
                f"{expected} (tied modules first, then the layers')",
                f"{RESUME}: the target stages' order would be guessed",
            )
        model = next(f.path for f in d.manifest.files if f.role == "model_states")
        recorded = [str(n) for n in states.state(src_dir / model).get("buffer_names") or []]
        if recorded != layers.buffer_names(held):
            raise ReshardUnsupported(
                f"--pipeline-parallel: stage {d.id}'s buffer_names {recorded} are not its layer files' buffers "
                f"{layers.buffer_names(held)}",
                f"{RESUME}: the target stages' would be guessed",
            )


def check_tied_copies(index: CheckpointIndex, plans: dict) -> None:
    """Every stage's copy of a tied module's master and moments equals the first stage's, bit for bit (CK401):
    each target stage running the tie is given one of them."""
    moments_of: dict = {}
    with ShardReader() as files:
        for param in index.parameters:
            if len(param.shards) < 2:
                continue
            copies = []
            for shard in param.shards:
                plan = plans[shard.domain]
                if shard.domain not in moments_of:
                    moments_of[shard.domain] = plan_optimizer_state(plan)
                moments = moments_of[shard.domain]
                sources = [plan.sources[shard.local_name]]
                sources += [moments.sources[n] for _, n in sorted(moments.states.get(shard.local_name, {}).items())]
                copies.append((shard.domain, [read_array(s, s.dtype, files).tobytes() for s in sources]))
            for domain, values in copies[1:]:
                if values != copies[0][1]:
                    raise ReconstructMismatch(
                        f"the tied {param.name!r}: stage {domain}'s master or moments differ from stage "
                        f"{copies[0][0]}'s",
                        plans[copies[0][0]].tag_dir,
                    )

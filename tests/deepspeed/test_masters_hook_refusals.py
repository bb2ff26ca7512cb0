"""The save hook of ZeRO stage-0 and MoE engines (and of a tensor x pipeline engine without its split rules) refuses
what it cannot describe before DeepSpeed writes anything (engine stand-ins with DeepSpeed 0.19.8's accessors: no job
needed), and rank 0 refuses a description the saved files contradict (the real hooked checkpoint of ``s0-bf16-ws2``)."""

from types import SimpleNamespace

import pytest
import torch
from _harness.parallel_oracles import info
from _harness.scenarios import hook_name

from ckptspec.checkpoint.states import StateCache
from ckptspec.deepspeed import save_checkpoint
from ckptspec.deepspeed.live.masters import resolve
from ckptspec.errors import EngineLayoutMismatch, UnsupportedEngine


def _class(name):
    return type(name, (), {})()


class _Engine:
    """What ``save_checkpoint`` reads of a DeepSpeed engine before it saves; ``saved`` if it saved."""

    def __init__(self, stage=0, moe=False, optimizer="FP16_UnfusedOptimizer", bf16=True, module=None, **kw):
        self.has_moe_layers, self.optimizer, self.module = moe, _class(optimizer), module or torch.nn.Linear(2, 2)
        self.mp_world_size, self.num_stages, self.saved = 1, 1, []
        self._stage, self._bf16 = stage, bf16
        self.checkpoint_engine = SimpleNamespace(is_decoupled=lambda: False)
        self.__dict__.update(kw)

    def zero_optimization_stage(self):
        return self._stage

    def bfloat16_enabled(self):
        return self._bf16

    def fp16_enabled(self):
        return False

    def save_checkpoint(self, *args, **kwargs):
        self.saved.append(args)


class PipelineEngine(_Engine):
    pass


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(2, 2, bias=False)
        self.b = torch.nn.Linear(2, 2, bias=False)
        self.b.weight = self.a.weight


def _frozen():
    module = torch.nn.Linear(2, 2)
    module.bias.requires_grad_(False)
    return module


@pytest.mark.parametrize(
    "engine,named",
    [
        (_Engine(stage=3, moe=True, optimizer="DeepSpeedZeroOptimizer_Stage3"), "MoE at ZeRO stage 3"),
        (_Engine(stage=1, moe=True, optimizer="DeepSpeedZeroOptimizer", mp_world_size=2), "tensor or pipeline"),
        (_Engine(mp_world_size=2), "stage0 combined with tensor or pipeline parallelism"),
        (_Engine(moe=True, optimizer="FP16_Optimizer"), "stage 0 MoE with FP16_Optimizer: only FP16_UnfusedOptimizer'"),
        (_Engine(optimizer="Adam"), "stage 0 with Adam: only FP16_UnfusedOptimizer and FP16_Optimizer's"),
        (PipelineEngine(optimizer="FP16_UnfusedOptimizer", mp_world_size=2, num_stages=2), "only BF16_Optimizer"),
        # tensor-parallel stages: described by the split rules the client state gives, none given here
        (PipelineEngine(optimizer="BF16_Optimizer", mp_world_size=4, num_stages=2), "saved without its split rules"),
        (PipelineEngine(optimizer="Adam", bf16=False, mp_world_size=4, num_stages=2), "pipeline with Adam: only BF16_"),
        (_Engine(module=_Tied()), "tied parameters"),
        (_Engine(module=_frozen(), bf16=False, optimizer="Adam"), "frozen parameter 'bias'"),
    ],
    ids=[
        "moe-stage3",
        "moe-tp",
        "stage0-tp",
        "moe-fp16-optimizer",
        "stage0-bf16-adam",
        "pipeline-unfused",
        "pipeline-tp",
        "pipeline-tp-fp32",
        "ties",
        "frozen",
    ],
)
def test_what_the_masters_hook_cannot_describe_is_refused_before_saving(engine, named, tmp_path):
    with pytest.raises(UnsupportedEngine, match=named):
        save_checkpoint(engine, tmp_path)
    assert engine.saved == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "client_state",
    [None, {"step": 2}, {"universal_checkpoint_info": {"universal_checkpoint_version": 0.2}}],
    ids=["none", "other-keys", "no-patterns"],
)
@pytest.mark.parametrize("stage,optimizer", [(1, "DeepSpeedZeroOptimizer"), (0, "BF16_Optimizer")])
def test_a_tensor_pipeline_saved_without_its_split_rules_is_refused_before_saving(
    stage, optimizer, client_state, tmp_path
):
    """A tensor x pipeline engine (Megatron-style layers: no rule DeepSpeed knows) at ZeRO 1 or stage 0 is described by
    the split rules its client state gives (Megatron-DeepSpeed's universal_checkpoint_info), as ``generate`` reads them
    back; without them nothing is written (before, DeepSpeed wrote its ZeRO-1 files, then the save failed, with them
    or without; a stage-0 one was refused whatever its client state)."""
    engine = PipelineEngine(stage=stage, optimizer=optimizer, mp_world_size=4, num_stages=2)
    with pytest.raises(UnsupportedEngine, match="saved without its split rules: pass them as Megatron-DeepSpeed"):
        save_checkpoint(engine, tmp_path, client_state=client_state)
    assert engine.saved == [] and list(tmp_path.iterdir()) == []


def _piece(**kw):
    piece = {
        "domain": "dense",
        "index": 0,
        "name": "blocks.0.up.weight",
        "shape": [32, 16],
        "file": "mp_rank_00_model_states.pt",
        "key": ["optimizer", "fp32_groups", 0, 0],
        "offset": 0,
        "numel": 512,
        "order": 0,
        "copy": False,
    }
    return {**piece, **kw}


@pytest.mark.parametrize(
    "pieces,named",
    [
        ([_piece()], None),  # what the engine said of the first master: found where it said
        ([_piece(shape=[16, 32])], r"has shape \[32, 16\], not where the live engine puts"),
        ([_piece(key=["optimizer", "fp32_groups", 0, 99])], "is not a saved tensor"),
        ([_piece(file="mp_rank_01_model_states.pt")], "is not a saved tensor"),
        ([_piece(numel=256)], r"do not make its shape \[32, 16\]"),
    ],
    ids=["found", "other-shape", "no-such-key", "no-such-file", "short"],
)
def test_rank_0_refuses_a_description_the_saved_files_contradict(ds, pieces, named):
    entry = ds.path(hook_name("s0-bf16-ws2"))
    tag_dir = entry / info(entry)["tag"]
    described = [{"kind": "stage0", "stage": 0, "pieces": pieces, "dtypes": {}, "stored_in": "model_states"}]
    if named is None:
        master = resolve(described, tag_dir, StateCache()).masters["blocks.0.up.weight"]
        assert master.shape == (32, 16) and master.dtype == "float32" and sum(s[2] for s in master.segments) == 2048
        return
    with pytest.raises(EngineLayoutMismatch, match=named):
        resolve(described, tag_dir, StateCache())


class _Dist:
    """torch.distributed of rank 0 in a job of two; rank 1 sends ``other``."""

    def __init__(self, other):
        self.other, self.gathers = other, 0

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_rank(self):
        return 0

    def get_world_size(self):
        return 2

    def all_gather_object(self, out, obj):
        self.gathers += 1
        out[:] = [obj, self.other]


def test_a_refusing_rank_still_joins_the_gather_and_every_rank_raises(monkeypatch):
    """No rank is left waiting in the gather while another refuses: the refusing rank takes part in
    it and raises after; a rank that did not refuse raises the other's refusal, naming its rank."""
    import ckptspec.deepspeed.live.masters as masters

    dist = _Dist((None, None))
    with pytest.raises(UnsupportedEngine, match="tied parameters"):
        masters.gather_described(_Engine(module=_Tied()), dist)
    assert dist.gathers == 1
    monkeypatch.setattr(masters, "local_masters", lambda engine, client_state=None: {"kind": "stage0"})
    dist = _Dist((None, "rank 1: UnsupportedEngine: frozen parameter 'x'"))
    with pytest.raises(UnsupportedEngine, match="another rank refused the engine: rank 1: .*frozen parameter"):
        masters.gather_described(_Engine(), dist)
    assert dist.gathers == 1

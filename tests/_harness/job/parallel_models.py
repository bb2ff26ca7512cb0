"""The models, configs and specs of the "parallel" jobs (job/parallel.py): pipeline, AutoTP, MoE,
and dense ZeRO stage 0 / universal sources; and the same models built whole (tp1/pp1/ep1) for the tests.

Runs inside the job and in the test process (``reference_model``); torch and DeepSpeed are
imported inside the functions. Everything in this folder is part of every job's cache key.

Spec keys (JSON object) are listed in DEFAULTS; unknown keys are an error. The layout follows
from the degrees: ``pp`` > 1 is a ``PipelineModule``, ``tp`` > 1 is AutoTP training
(``tensor_parallel.autotp_size``) or, in a pipeline, Megatron-style tensor-parallel layers
(tp_layers.py), ``ep`` > 0 is a model with a ``deepspeed.moe.layer.MoE`` of ``experts`` experts;
none of them is the dense MLP.
"""

import copy

DEFAULTS = {
    "stage": 1,  # ZeRO stage 0..3
    "dtype": "fp32",  # fp32 | bf16 | fp16 (main.py lets DeepSpeed's CPU accelerator train fp16)
    # "torch": a client torch.optim.Adam (ZeRO stage 0 bf16/fp16: FP16_UnfusedOptimizer); "fused": a
    # FusedAdam that steps as torch's Adam (stage 0 bf16/fp16: FP16_Optimizer, flat fp32 groups)
    "optimizer": "torch",
    "buffers": False,  # the dense or AutoTP MLP: a float and an int persistent buffer, updated by the forward
    # the dense or AutoTP MLP: blocks.0.up.weight (AutoTP splits it, column-parallel) and head.bias
    # (AutoTP leaves it whole on every tensor rank) frozen; a pipeline: layer 2's up.weight
    "frozen": False,
    # a pipeline: layer 0 and layer 4 one bias-free Linear (TiedLayerSpec "emb", one on each stage; with ``frozen``
    # and ``buffers`` it holds a frozen gain and a buffer too: _tied_class); the AutoTP
    # MLP: ``inp`` and ``out``, two bias-free Linear layers sharing one weight that AutoTP leaves whole (AutoTP
    # 0.19.8 cannot split a tied weight: deepspeed.initialize fails, or slices the other use with it)
    "tied": False,
    # the dense or AutoTP MLP with fused blocks (_fused_net): each a ``gate_up_proj`` Linear (gate and up halves)
    # and a ``down_proj``; under AutoTP DeepSpeed's heuristic rules (no partition_config) make gate_up_proj a
    # GateUpPack_LinearLayer, whose shard holds one piece of each half (a multi-piece affine_map entry).
    # "qkv": blocks of a fused ``qkv_proj`` (q, k, v thirds) in a class named ``...DecoderLayer``, which the heuristic
    # rules make DeepSpeed's fused_LinearLayer (glm layout: one piece of each third per rank), and a ``down_proj``.
    # "subparam": blocks of a fused ``qkv`` of unequal sub-parameters (FUSED_QKV_SIZES) and an ``o`` whose input is
    # the same three, by partition_config ``shape`` specs (FUSED_SUBPARAM_SPECS): SubParamLinearLayer and the
    # row-parallel SubParamLinearAllreduce (its pieces cut along axis 1); "subparam-uneven": the same of 30, 17 and 17
    # (FUSED_QKV_SIZES_UNEVEN), which DeepSpeed cuts unevenly over 2 ranks (15/15, 9/8, 9/8)
    "fused": False,
    "pp": 1,  # pipeline stages (a PipelineModule when above 1)
    "pipe": False,  # a PipelineModule whatever ``pp`` (at pp 1: the whole pipeline on one stage)
    "partition": "uniform",  # the PipelineModule's partition_method: "uniform" | "parameters"
    "tp": 1,  # AutoTP degree
    "ep": 0,  # expert-parallel degree of the MoE layer (0: no MoE)
    "experts": 0,  # experts of the MoE layer
    "moe_layers": 1,  # MoE layers one after the other (``moe``, then ``moe2``: DeepSpeed's layer_1_expert_* files)
    "grad_accum_dtype": None,  # data_types.grad_accum_dtype
    # fp16: DeepSpeed's fp16.loss_scale_window (its default 1000); 1 doubles the dynamic scale after every step
    # without overflow, so a checkpoint's scale is none a new job starts with
    "loss_scale_window": None,
    "steps": 2,
    "seed": 1234,
    "save": True,  # False: train and record, write no checkpoint (the "+again" entries)
    "save_with": "deepspeed",  # "ckptspec": through ckptspec.deepspeed.save_checkpoint (the save hook: index sidecar)
    "universal": False,  # convert the saved tag with DeepSpeed's ds_to_universal (rank 0) and record the outcome
    "inject_missing_state": False,  # ds_to_universal --inject_missing_state
}

W, H, C = 16, 32, 5  # width, hidden width, classes (odd: ZeRO partitions need padding)
MOE_TOKENS = 8  # tokens per sample of the MoE model (DeepSpeed's min_capacity is 4 per rank)
BATCH = 2  # micro batch per rank
EVAL_SEED = 99  # the fixed batch whose logits every job records
BUCKET = 2**16  # ZeRO reduce/allgather bucket, in elements (the models have < 4000 parameters)


def normalize(spec):
    unknown = set(spec) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown parallel spec keys: {sorted(unknown)}")
    out = copy.deepcopy(DEFAULTS)
    out.update(copy.deepcopy(spec))
    if out["stage"] not in (0, 1, 2, 3) or out["dtype"] not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"bad stage/dtype in parallel spec: {spec}")
    if out["optimizer"] not in ("torch", "fused"):
        raise ValueError(f"bad optimizer in parallel spec: {spec}")
    for key in ("buffers", "frozen"):
        if out[key] and layout(out) not in ("dense", "autotp", "pipe"):
            raise ValueError(f"{key} are in the dense or AutoTP MLP or the pipeline only: {spec}")
    if out["fused"] not in (False, True, "qkv", "subparam", "subparam-uneven"):
        raise ValueError(f"bad fused in parallel spec: {spec}")
    if out["fused"] and (layout(out) not in ("dense", "autotp") or out["frozen"] or out["buffers"] or out["tied"]):
        raise ValueError(f"fused blocks are in the plain dense or AutoTP MLP only: {spec}")
    if out["tied"] and layout(out) not in ("pipe", "autotp"):
        raise ValueError(f"tied layers are in the pipeline or the AutoTP MLP only: {spec}")
    if out["ep"] and (out["pp"] > 1 or out["pipe"] or out["tp"] > 1 or out["experts"] % out["ep"]):
        raise ValueError(f"MoE jobs are data/expert parallel only, experts divisible by ep: {spec}")
    if out["loss_scale_window"] is not None and out["dtype"] != "fp16":
        raise ValueError(f"loss_scale_window is an fp16 setting: {spec}")
    if out["moe_layers"] not in (1, 2) or (out["moe_layers"] != 1 and not out["ep"]):
        raise ValueError(f"moe_layers is 1 or 2, in a MoE job: {spec}")
    if layout(out) == "pipe" and out["tp"] > 1 and out["stage"] > 1:
        # Megatron-style tensor-parallel layers (job/tp_layers.py), not AutoTP: DeepSpeed 0.19.8's AutoTP builds
        # its groups on a (world/tp, tp) mesh that ignores the pipeline axis, so engine._broadcast_model
        # broadcasts one stage's weights to the other (gloo: "Received data size doesn't match expected size")
        raise ValueError(f"a tensor-parallel pipeline is at ZeRO 0/1: {spec}")
    if out["partition"] not in ("uniform", "parameters"):
        raise ValueError(f"bad partition in parallel spec: {spec}")
    if out["save_with"] not in ("deepspeed", "ckptspec"):
        raise ValueError(f"bad save_with in parallel spec: {spec}")
    if out["universal"] and not out["save"]:
        raise ValueError(f"universal needs save: {spec}")
    return out


def layout(spec):
    """The model family: "moe", "pipe" (any pp > 1 or ``pipe``, with or without tp), "autotp" or "dense"."""
    if spec["ep"]:
        return "moe"
    if spec["pp"] > 1 or spec["pipe"]:
        return "pipe"
    if spec["tp"] > 1:
        return "autotp"
    return "dense"


# AutoTP's partition rules, by parameter name (DeepSpeed's partition_config.layer_specs).
TP_LAYER_SPECS = [
    {"patterns": [r".*\.up\.weight$", r".*\.up\.bias$"], "partition_type": "column"},
    {"patterns": [r".*\.down\.weight$"], "partition_type": "row"},
]
# The "subparam" model's fused widths (q, k, v: fewer key/value rows, as a grouped-query attention's) and its
# partition_config specs: ``qkv`` cut per sub-parameter along its output rows, ``o`` along its input columns.
FUSED_QKV_SIZES = [32, 16, 16]
FUSED_QKV_SIZES_UNEVEN = [30, 17, 17]


def _subparam_specs(sizes):
    return [
        {"patterns": [r".*\.qkv\.weight$", r".*\.qkv\.bias$"], "partition_type": "column", "shape": [sizes, -1]},
        {"patterns": [r".*\.o\.weight$"], "partition_type": "row", "shape": [-1, sizes], "partition_dim": 1},
    ]


FUSED_SUBPARAM_SPECS = _subparam_specs(FUSED_QKV_SIZES)


def _block_class():
    import torch
    from torch import nn

    class Block(nn.Module):
        """x + down(relu(up(x))): ``up`` column-parallel and ``down`` row-parallel under AutoTP."""

        def __init__(self):
            super().__init__()
            self.up = nn.Linear(W, H)
            self.down = nn.Linear(H, W)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    return Block


def _mlp_net(buffers=False, frozen=False, tied=False):
    import torch
    from torch import nn

    Block = _block_class()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(2)])
            self.head = nn.Linear(W, C)
            if frozen:  # the optimizer never sees them (job/parallel.py), DeepSpeed saves them in the module
                self.blocks[0].up.weight.requires_grad_(False)
                self.head.bias.requires_grad_(False)
            if buffers:  # saved in the module beside the weights (buffer_names), never in the optimizer
                self.register_buffer("running", torch.zeros(W))
                self.register_buffer("step_count", torch.tensor(0, dtype=torch.int64))
            if tied:  # one weight under two names (DeepSpeed saves both, shared_params names the tie)
                self.inp = nn.Linear(W, W, bias=False)
                self.out = nn.Linear(W, W, bias=False)
                self.out.weight = self.inp.weight

        def forward(self, x):
            if buffers and self.training:
                with torch.no_grad():
                    self.running.mul_(0.5).add_(x.mean(0).to(self.running.dtype), alpha=0.5)
                    self.step_count += 1
            if tied:
                x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            if tied:
                x = self.out(torch.relu(x))
            return self.head(x)

    return Net()


def _fused_net():
    import torch
    from torch import nn

    class FusedBlock(nn.Module):
        """x + down_proj(silu(gate) * up), gate and up the two halves of ``gate_up_proj``'s output."""

        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Linear(W, 2 * H)
            self.down_proj = nn.Linear(H, W)

        def forward(self, x):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return x + self.down_proj(nn.functional.silu(gate) * up)

    # AutoTP's heuristic rules want a model class named ``...Model`` (AutoTP.supported)
    class FusedMlpModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([FusedBlock() for _ in range(2)])
            self.head = nn.Linear(W, C)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(torch.relu(x))

    return FusedMlpModel()


def _fused_qkv_net():
    import torch
    from torch import nn

    # AutoTP's heuristic rules make a Linear named ``qkv_proj`` a fused_LinearLayer; the class name holds
    # ``DecoderLayer``, which its fused-QKV table reads as the glm layout (q, k, v thirds, each split over the ranks)
    class QkvDecoderLayer(nn.Module):
        """x + down_proj(silu(q) * k + v), q, k and v the three thirds of ``qkv_proj``'s output."""

        def __init__(self):
            super().__init__()
            self.qkv_proj = nn.Linear(W, 3 * H)
            self.down_proj = nn.Linear(H, W)

        def forward(self, x):
            q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
            return x + self.down_proj(nn.functional.silu(q) * k + v)

    class FusedQkvModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([QkvDecoderLayer() for _ in range(2)])
            self.head = nn.Linear(W, C)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(torch.relu(x))

    return FusedQkvModel()


def _fused_subparam_net(sizes):
    import torch
    from torch import nn

    class SubParamBlock(nn.Module):
        """x + o(silu(qkv(x))): ``o``'s input columns are ``qkv``'s output rows, both cut per sub-parameter."""

        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(W, sum(sizes))
            self.o = nn.Linear(sum(sizes), W)

        def forward(self, x):
            return x + self.o(nn.functional.silu(self.qkv(x)))

    class FusedSubParamModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([SubParamBlock() for _ in range(2)])
            self.head = nn.Linear(W, C)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(torch.relu(x))

    return FusedSubParamModel()


def _fused_model(kind):
    if kind in ("subparam", "subparam-uneven"):
        return _fused_subparam_net(FUSED_QKV_SIZES if kind == "subparam" else FUSED_QKV_SIZES_UNEVEN)
    return {True: _fused_net, "qkv": _fused_qkv_net}[kind]()


def _buffer_block_class():
    import torch

    Block = _block_class()

    class BufferBlock(Block):
        """A Block with a persistent buffer, updated by the training forward (saved in its layer file)."""

        def __init__(self):
            super().__init__()
            self.register_buffer("running", torch.zeros(W))

        def forward(self, x):
            if self.training:
                with torch.no_grad():
                    self.running.mul_(0.5).add_(x.detach().float().mean(0).to(self.running.dtype), alpha=0.5)
            return super().forward(x)

    return BufferBlock


def _tied_class(frozen, buffers):
    import torch
    from torch import nn

    class Tied(nn.Linear):
        """The TiedLayerSpec's module, a bias-free Linear. ``frozen``: a gain its constructor freezes, the same
        values on every stage (PipelineModule broadcasts only the tied weight, each stage builds its own gain);
        ``buffers``: a persistent buffer its training forward updates, so each stage's copy holds its own value."""

        def __init__(self):
            super().__init__(W, W, bias=False)
            if frozen:
                self.gain = nn.Parameter(torch.linspace(0.5, 1.5, W), requires_grad=False)
            if buffers:
                self.register_buffer("seen", torch.zeros(W))

        def forward(self, x):
            if buffers and self.training:
                with torch.no_grad():
                    self.seen.mul_(0.5).add_(x.detach().float().mean(0).to(self.seen.dtype), alpha=0.5)
            out = super().forward(x)
            return out * self.gain.to(out.dtype) if frozen else out

    return Tied


def _pipe_layers(spec=None):
    """(class, args, kwargs, tie key) of each pipeline layer; layer 1 has no parameters (its file is an
    empty dict). With ``tied``, layer 0 is a bias-free Linear that layer 4 repeats (six layers: 0-2 on
    stage 0, 3-5 on stage 1); with ``buffers``, layer 3 holds a buffer (and the tied module one)."""
    from torch import nn

    spec = spec or DEFAULTS
    Block = _block_class()
    third = (_buffer_block_class() if spec["buffers"] else Block, (), {}, None)
    if not spec["tied"]:
        return [
            (nn.Linear, (W, W), {}, None),
            (nn.ReLU, (), {}, None),
            (Block, (), {}, None),
            third,
            (nn.Linear, (W, C), {}, None),
        ]
    tied = (_tied_class(spec["frozen"], spec["buffers"]), (), {}, "emb")
    return [tied, (nn.ReLU, (), {}, None), (Block, (), {}, None), third, tied, (nn.Linear, (W, C), {}, None)]


PIPE_FROZEN = "2.up.weight"  # frozen in a pipeline with ``frozen`` (stage 0)


def _moe_net(spec, ep_size):
    import torch
    from deepspeed.moe.layer import MoE
    from torch import nn

    def moe_layer():
        expert = nn.Sequential(nn.Linear(W, H), nn.ReLU(), nn.Linear(H, W))
        # eval_capacity_factor = experts: an expert's capacity is every token, so evaluation
        # drops none and the logits do not depend on the random token selection.
        return MoE(
            hidden_size=W,
            expert=expert,
            num_experts=spec["experts"],
            ep_size=ep_size,
            k=1,
            eval_capacity_factor=float(spec["experts"]),
        )

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(W, W)
            self.moe = moe_layer()
            if spec["moe_layers"] == 2:  # DeepSpeed numbers MoE layers in module order: its files layer_1_expert_*
                self.moe2 = moe_layer()
            self.head = nn.Linear(W, C)

        def forward(self, x):
            h, l_aux, _ = self.moe(torch.relu(self.inp(x)))
            if spec["moe_layers"] == 2:  # no ReLU before its gate: its tokens of every sign reach both its experts
                h, l_aux2, _ = self.moe2(h)
                l_aux = l_aux + l_aux2
            return self.head(h), l_aux

    return Net()


def build_model(spec):
    """The model the job trains (a PipelineModule for pp > 1); call after ``torch.manual_seed``."""
    kind = layout(spec)
    if kind == "moe":
        return _moe_net(spec, spec["ep"])
    if kind == "pipe" and spec["tp"] > 1:
        from _harness.job.tp_layers import build_tp_pipe

        return build_tp_pipe(spec)
    if kind == "pipe":
        import torch
        from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

        specs = [
            TiedLayerSpec(key, cls, *args, **kwargs) if key else LayerSpec(cls, *args, **kwargs)
            for cls, args, kwargs, key in _pipe_layers(spec)
        ]
        model = PipelineModule(
            layers=specs,
            num_stages=spec["pp"],
            loss_fn=torch.nn.CrossEntropyLoss(),
            partition_method=spec["partition"],
        )
        for name, param in model.named_parameters():  # only the stage that builds layer 2 has it
            if spec["frozen"] and name == PIPE_FROZEN:
                param.requires_grad_(False)
        return model
    if spec["fused"]:
        return _fused_model(spec["fused"])
    return _mlp_net(spec["buffers"], spec["frozen"], spec["tied"])


def reference_model(spec):
    """The same model whole (tp1/pp1/ep1), named as the parallel job's parameters are named at
    tp1/pp1: ``<layer>.<name>`` for a pipeline, the module path otherwise, every expert under its
    global index. Its weights are random: load the merged checkpoint into it."""
    kind = layout(spec)
    if kind == "moe":
        return _moe_net(spec, 1)
    if kind == "pipe":
        from torch import nn

        built: dict = {}  # a tie key's one module, at each of its layers
        layers = []
        for cls, args, kwargs, key in _pipe_layers(spec):
            module = built.get(key) or cls(*args, **kwargs)
            if key:
                built[key] = module
            layers.append(module)
        return nn.Sequential(*layers)
    if spec["fused"]:
        return _fused_model(spec["fused"])
    return _mlp_net(spec["buffers"], spec["frozen"], spec["tied"])


def ds_config(spec):
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 2 if layout(spec) == "pipe" else 1,
        "steps_per_print": 10**6,
        # DeepSpeed's default buckets are 5e8 elements, which ZeRO 1/2 touch (2 GB per rank in fp32,
        # 4 GB at the peak of a pipeline step): the machine runs out of memory at world size 4.
        "zero_optimization": {"stage": spec["stage"], "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET},
    }
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec["dtype"] == "fp16":
        # A small initial loss scale: overflow-skipped steps would leave the weights untouched.
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
        if spec["loss_scale_window"]:
            cfg["fp16"]["loss_scale_window"] = spec["loss_scale_window"]
    if spec["grad_accum_dtype"]:
        cfg["data_types"] = {"grad_accum_dtype": spec["grad_accum_dtype"]}
    if spec["tp"] > 1 and layout(spec) == "autotp" and spec["fused"] in ("subparam", "subparam-uneven"):
        sizes = FUSED_QKV_SIZES if spec["fused"] == "subparam" else FUSED_QKV_SIZES_UNEVEN
        cfg["tensor_parallel"] = {
            "autotp_size": spec["tp"],
            "partition_config": {"use_default_specs": False, "layer_specs": _subparam_specs(sizes)},
        }
    elif spec["tp"] > 1 and layout(spec) == "autotp" and spec["fused"]:
        cfg["tensor_parallel"] = {"autotp_size": spec["tp"]}  # DeepSpeed's heuristic rules: GateUpPack_LinearLayer
    elif spec["tp"] > 1 and layout(spec) == "autotp":
        cfg["tensor_parallel"] = {
            "autotp_size": spec["tp"],
            "partition_config": {"use_default_specs": False, "layer_specs": TP_LAYER_SPECS},
        }
    return cfg


def batch(spec, seed):
    """(inputs, targets) of one micro batch: (BATCH, W) or, for MoE, (BATCH, MOE_TOKENS, W) in fp32."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if spec["ep"]:
        x = torch.randn(BATCH, MOE_TOKENS, W, generator=g)
        return x, torch.randint(0, C, (BATCH * MOE_TOKENS,), generator=g)
    return torch.randn(BATCH, W, generator=g), torch.randint(0, C, (BATCH,), generator=g)


def torch_dtype(spec):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[spec["dtype"]]

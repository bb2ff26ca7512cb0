"""``ckptspec.torch.manifest_from_module``: stage-0 manifests from a plain torch module (#3)."""

import torch
import torch.nn as nn

from ckptspec.format.validate import validate_document
from ckptspec.torch import manifest_from_module


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 2)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.frozen.requires_grad_(False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def _roles(manifest):
    return {
        "trainable": [[p.name for p in g.params] for g in manifest.groups],
        "frozen": [f.name for f in manifest.frozen],
        "aliases": {a.name: a.owner for a in manifest.aliases},
        "buffers": [b.name for b in manifest.buffers],
    }


def test_module_without_optimizer():
    model = TinyLM()
    manifest = manifest_from_module(model)
    assert validate_document(manifest.to_dict()).findings == []
    assert _roles(manifest) == {
        "trainable": [["emb.weight", "body.weight", "body.bias"]],
        "frozen": ["frozen.weight", "frozen.bias"],
        "aliases": {"head.weight": "emb.weight"},
        "buffers": ["steps"],  # the non-persistent buffer is not saved
    }
    # Every key of the real state dict has exactly one role.
    roles = _roles(manifest)
    named = (
        [n for group in roles["trainable"] for n in group] + roles["frozen"] + list(roles["aliases"]) + roles["buffers"]
    )
    assert sorted(named) == sorted(model.state_dict())
    group = manifest.groups[0]
    assert group.padded_numel == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert manifest.buffers[0].shape == [] and manifest.buffers[0].dtype == "int64"


def test_groups_follow_the_optimizer():
    model = TinyLM()
    optimizer = torch.optim.AdamW(
        [
            {"params": [model.body.bias], "weight_decay": 0.0},
            {"params": [model.emb.weight, model.body.weight]},
        ]
    )
    manifest = manifest_from_module(model, optimizer)
    assert validate_document(manifest.to_dict()).findings == []
    assert _roles(manifest)["trainable"] == [["body.bias"], ["emb.weight", "body.weight"]]
    assert [g.optimizer_group for g in manifest.groups] == [0, 1]
    assert manifest.layout.optimizer == "AdamW" and manifest.layout.zero_stage == 0
    assert [p.offset for p in manifest.groups[1].params] == [0, 40]

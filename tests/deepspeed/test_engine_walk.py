"""The one-walk module traversal (``deepspeed/engine_walk.py``) lists what torch's own walks list.

Oracle: torch's ``named_parameters``, ``parameters``, ``named_modules`` with each module's
``named_parameters(recurse=False)``, and ``named_buffers`` (``engine_walk.torch_walk``), on trees
with what changes their order and de-duplication: a module registered at two paths, a parameter
tied across modules and within one, ``None`` parameters, buffers and children, non-persistent and
shared buffers. Real engines: the save hook's manifests in ``test_embed.py`` and the live engine's
in ``test_producers.py`` are built through it.
"""

from __future__ import annotations

import torch
from torch import nn

from ckptspec.deepspeed.live.walk import ModuleWalk, torch_walk, walk_module


def _tricky() -> nn.Module:
    shared = nn.Linear(3, 3)
    root = nn.Sequential(nn.Linear(3, 4), shared, nn.Sequential(nn.LayerNorm(3), shared), nn.ReLU())
    root.head = nn.Linear(4, 5)
    root.tail = nn.Linear(5, 4)
    root.tail.weight = root.head.weight  # tied across modules (shapes need not agree for the walk)
    root.head.register_parameter("twin", root.head.bias)  # tied within one module
    root.head.register_parameter("gone", None)
    root.register_buffer("steps", torch.zeros(2))
    root.register_buffer("scratch", torch.ones(1), persistent=False)
    root[0].register_buffer("steps_again", root.steps)  # one buffer at two names
    root[0].register_buffer("missing", None)
    root.add_module("hole", None)
    return root


def _plain(walk: ModuleWalk) -> tuple:
    return (
        sorted(walk.names.items()),
        [id(p) for p in walk.params],
        [(n, id(p)) for n, p in walk.local_params],
        [(n, id(b)) for n, b in walk.buffers],
        [(n, id(p)) for n, p in walk.tied],
    )


def _tied_by_torch(model: nn.Module) -> list[str]:
    """The names under which torch's per-module walk meets a parameter it met before."""
    seen, tied = set(), []
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                tied.append(f"{module_name}.{name}" if module_name else name)
            seen.add(id(param))
    return tied


def test_one_walk_lists_what_torch_lists():
    deep = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)) for _ in range(50)])
    for model in (_tricky(), deep):
        assert _plain(walk_module(model)) == _plain(torch_walk(model))
    walk = walk_module(_tricky())
    # The tree has what the walk must get right: ties seen twice, one buffer at two names kept once.
    assert len(walk.local_params) > len(walk.params) and [n for n, _ in walk.buffers] == ["steps", "scratch"]
    assert [n for n, _ in walk.tied] == _tied_by_torch(_tricky()) == ["tail.weight"]


def test_aliases_by_identity_are_those_by_key():
    """Without ``ds_id`` the aliases come from the walk's ties; with it, from every local param's key."""
    from ckptspec.deepspeed.live.state import aliases_of_engine

    model = _tricky()
    by_identity = aliases_of_engine(walk_module(model))
    for key, param in enumerate(model.parameters()):
        param.ds_id = key  # one key per object, as identity
    by_key = aliases_of_engine(walk_module(model))
    assert [a.model_dump() for a in by_identity] == [a.model_dump() for a in by_key]
    assert [(a.name, a.owner, a.shape) for a in by_key] == [("tail.weight", "head.weight", [5, 4])]


def test_persistent_buffers_are_those_a_state_dict_saves():
    for model in (_tricky(), nn.Sequential(nn.BatchNorm1d(2), nn.Linear(2, 2))):
        model[0].register_buffer("scratch", torch.ones(1), persistent=False)
        walk = walk_module(model)
        saved = set(model.state_dict())
        assert walk.persistent == {n for n, _ in walk.buffers if n in saved}
        assert walk.persistent and walk.persistent != {n for n, _ in walk.buffers}
    assert torch_walk(model).persistent is None  # asked of DeepSpeed then


def test_a_module_that_walks_its_own_way_is_asked_of_torch():
    class OwnWalk(nn.Linear):
        def named_parameters(self, *args, **kwargs):  # e.g. hides a parameter
            return iter([("weight", self.weight)])

    model = nn.Sequential(nn.Linear(2, 2), OwnWalk(2, 2))
    walk = walk_module(model)
    assert _plain(walk) == _plain(torch_walk(model))
    assert [name for name, _ in walk.local_params] == ["0.weight", "0.bias", "1.weight"]

"""One walk over a live module tree for everything the engine's manifest reads from it.

``engine_layout`` needs the parameter names (``named_parameters``), the parameters in order
(``parameters``), every (module, local name) of each parameter (tied parameters), the buffers
(``named_buffers``) and which of them are saved (DeepSpeed's ``_get_buffer_names``). Asked of
torch and DeepSpeed one by one, each is a walk of the whole tree through nested generators: at
100k parameters those walks were half of ``manifest_from_engine``. Here one loop gives all five,
in torch's order and with torch's de-duplication (a module or tensor met again is skipped); a
tree whose classes change how torch walks it is asked of torch instead.
``tests/deepspeed/test_engine_walk.py`` compares both on trees with shared modules, tied
parameters and non-persistent buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# What the walk reproduces: a class overriding any of these walks differently, so torch is asked.
_TRAVERSAL = (
    "named_modules",
    "_named_members",
    "named_parameters",
    "parameters",
    "named_buffers",
    "named_children",  # DeepSpeed's _get_buffer_names walks with it
    "__hash__",
    "__eq__",
)


@dataclass
class ModuleWalk:
    # id(param) -> its first name, in the order of ``params``: names.values() are the params' names
    names: dict[int, str] = field(default_factory=dict)
    params: list = field(default_factory=list)  # module.parameters(), in order
    # (full name, param) for each module's own parameters (module.named_parameters(recurse=False)
    # of every module of module.named_modules()): where tied parameters show up
    local_params: list[tuple[str, Any]] = field(default_factory=list)
    # Those of ``local_params`` whose param was met before: tied, named by an alias of its first name
    tied: list[tuple[str, Any]] = field(default_factory=list)
    buffers: list[tuple[str, Any]] = field(default_factory=list)  # module.named_buffers()
    # The names of ``buffers`` a state_dict saves (not in their module's _non_persistent_buffers_set:
    # DeepSpeed's _get_buffer_names); None from torch_walk, where DeepSpeed is asked.
    persistent: set[str] | None = None


def walk_module(root) -> ModuleWalk:
    """The module tree's parameters and buffers as torch's own walks list them."""
    from torch import nn

    plain: dict[type, bool] = {}  # class -> walks as nn.Module does
    traversal = [getattr(nn.Module, a) for a in _TRAVERSAL]
    persistent: set[str] = set()  # this walk's (ModuleWalk's may be None: torch_walk's)
    walk = ModuleWalk(persistent=persistent)
    names, params, local_params, tied, buffers = (
        walk.names,
        walk.params,
        walk.local_params,
        walk.tied,
        walk.buffers,
    )
    seen_modules: set[int] = set()
    seen_buffers: set[int] = set()
    stack = [("", root)]  # pre-order, children in order: named_modules()
    pop, push_all = stack.pop, stack.extend
    while stack:  # 60k modules in a 100k-parameter mixture of experts: every step here counts
        prefix, module = pop()
        kind = type(module)
        as_torch = plain.get(kind)
        if as_torch is None:
            as_torch = plain[kind] = all(getattr(kind, a) is t for a, t in zip(_TRAVERSAL, traversal))
        if not as_torch:
            return torch_walk(root)
        module_id = id(module)
        if module_id in seen_modules:
            continue
        seen_modules.add(module_id)
        dot = prefix + "." if prefix else ""
        own = module._parameters
        if own:
            mine: set[int] = set()
            for key, param in own.items():
                if param is None:
                    continue
                param_id = id(param)
                if param_id in mine:
                    continue
                mine.add(param_id)
                name = dot + key
                local_params.append((name, param))
                if param_id not in names:
                    names[param_id] = name
                    params.append(param)
                else:
                    tied.append((name, param))
        if module._buffers:
            for key, buf in module._buffers.items():
                if buf is not None and id(buf) not in seen_buffers:
                    seen_buffers.add(id(buf))
                    buffers.append((dot + key, buf))
                    if key not in module._non_persistent_buffers_set:
                        persistent.add(dot + key)
        children = module._modules
        if children:
            if len(children) == 1:
                ((key, child),) = children.items()
                if child is not None:
                    stack.append((dot + key, child))
            else:
                push_all(reversed([(dot + key, child) for key, child in children.items() if child is not None]))
    return walk


def torch_walk(root) -> ModuleWalk:
    """The same, asked of torch (its generators, one walk each)."""
    walk = ModuleWalk()
    for name, param in root.named_parameters():
        walk.names[id(param)] = name
        walk.params.append(param)
    seen: set[int] = set()
    for module_name, module in root.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            walk.local_params.append((full, param))
            if id(param) in seen:
                walk.tied.append((full, param))
            seen.add(id(param))
    walk.buffers = list(root.named_buffers())
    return walk

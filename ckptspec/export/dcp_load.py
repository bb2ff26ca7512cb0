"""``ckptspec.load_state_dict(DCP_DIR)``: a torch DCP checkpoint's model state dict in memory (issue #42).

The checkpoint is checked first (``checkpoint.dcp.checks``: any error finding raises ``CheckpointInvalid``, nothing
read beyond what the checks read). Every tensor entry under ``model.`` is read under its name without that prefix,
each chunk's runs read into their place of the whole tensor (``dcp_input.located``; at a URL in range requests, a few
in flight, never a whole file), then cast as the DeepSpeed path
casts: floating tensors to ``dtype``, integer and bool ones kept. A DCP save records no tie: both names of a tied
weight are read, each its own array (equal, not the same object).
"""

from __future__ import annotations

import os
from typing import Any

from ..checkpoint.dcp.checks import check_dcp
from ..errors import CheckpointInvalid
from ..findings import has_errors
from ..format.dtypes import FLOATING, output_dtype
from ..location import location
from .arrays import ShardReader, _np, _np_dtype, convert
from .checkpoint import numpy_bfloat16
from .dcp_input import items_of, located, model_entries, model_fqn


def dcp_state_dict(directory: str | os.PathLike, framework: str = "torch", dtype: Any = "fp32") -> dict[str, Any]:
    """The model state dict of the DCP checkpoint in ``directory``, as torch tensors or numpy arrays."""
    if framework not in ("torch", "numpy"):
        raise ValueError(f"framework must be 'torch' or 'numpy', not {framework!r}")
    dtype = output_dtype(dtype)
    bf16_view = numpy_bfloat16() if framework == "numpy" and dtype == "bfloat16" else None
    source = location(directory)  # a URL: ranged reads (docs/remote.md)
    meta, findings = check_dcp(source)
    if has_errors(findings):
        raise CheckpointInvalid(findings, str(directory))
    np = _np()
    items = items_of(meta)
    tensors = model_entries(meta)
    segments = {name: located(source, items, model_fqn(meta, name), e) for name, e in tensors.items()}
    out: dict[str, Any] = {}
    reader = ShardReader()
    try:
        reader.plan([seg for segs in segments.values() for seg in segs])
        for name, entry in tensors.items():
            raw = np.empty(int(np.prod(entry.size, dtype=np.int64)), dtype=_np_dtype(entry.dtype))
            view, pos = memoryview(raw).cast("B"), 0
            for seg in segments[name]:  # in the whole tensor's order, covering it once (CK250)
                reader.read_into(seg, view[pos : pos + seg.nbytes])
                pos += seg.nbytes
            target = dtype if entry.dtype in FLOATING else entry.dtype
            array = convert(raw, entry.dtype, target).reshape(entry.size)
            if framework == "torch":
                from .writers import to_torch

                out[name] = to_torch(array, target)
            else:
                out[name] = array.view(bf16_view) if target == "bfloat16" else array
    finally:
        reader.close()
    return out

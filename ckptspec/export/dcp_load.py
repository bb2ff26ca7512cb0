"""``ckptspec.load_state_dict(DCP_DIR)``: a torch DCP checkpoint's model state dict in memory (issue #42).

The checkpoint is checked first (``checkpoint.dcp.checks``: any error finding raises ``CheckpointInvalid``, nothing
read beyond what the checks read). Every tensor entry under ``model.`` is read under its name without that prefix,
each chunk's runs read into their place of the whole tensor (``checkpoint.dcp.runs``), then cast as the DeepSpeed path
casts: floating tensors to ``dtype``, integer and bool ones kept. A DCP save records no tie: both names of a tied
weight are read, each its own array (equal, not the same object).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..checkpoint.dcp.checks import check_dcp
from ..checkpoint.dcp.records import read_record
from ..checkpoint.dcp.runs import runs
from ..errors import CheckpointInvalid, FileUnreadable
from ..findings import has_errors
from ..format.dtypes import FLOATING, ITEMSIZE, output_dtype
from .arrays import _np, _np_dtype, convert
from .checkpoint import numpy_bfloat16
from .dcp_input import model_entries, model_fqn


def dcp_state_dict(directory: str | os.PathLike, framework: str = "torch", dtype: Any = "fp32") -> dict[str, Any]:
    """The model state dict of the DCP checkpoint in ``directory``, as torch tensors or numpy arrays."""
    if framework not in ("torch", "numpy"):
        raise ValueError(f"framework must be 'torch' or 'numpy', not {framework!r}")
    dtype = output_dtype(dtype)
    bf16_view = numpy_bfloat16() if framework == "numpy" and dtype == "bfloat16" else None
    source = Path(directory)
    meta, findings = check_dcp(source)
    if has_errors(findings):
        raise CheckpointInvalid(findings, str(directory))
    np = _np()
    items = {(i.fqn, i.chunk_offset): i for i in meta.items}
    out: dict[str, Any] = {}
    handles: dict[str, Any] = {}
    try:
        for name, entry in model_entries(meta).items():
            itemsize = ITEMSIZE[entry.dtype]
            raw = np.empty(int(np.prod(entry.size, dtype=np.int64)), dtype=_np_dtype(entry.dtype))
            view = memoryview(raw).cast("B")
            for chunk in entry.chunks:
                item = items[(model_fqn(meta, name), chunk.offsets)]  # CK251 checked it is there
                fh = handles.get(item.file)
                if fh is None:
                    fh = handles[item.file] = open(source / item.file, "rb")  # closed below
                record = read_record(fh, source / item.file, item.offset, item.length)
                for src, dst, n in runs(entry.size, chunk):
                    fh.seek(record.data_offset + src * itemsize)
                    if fh.readinto(view[dst * itemsize : (dst + n) * itemsize]) != n * itemsize:
                        raise FileUnreadable(source / item.file, OSError("the file changed while read"))
            target = dtype if entry.dtype in FLOATING else entry.dtype
            array = convert(raw, entry.dtype, target).reshape(entry.size)
            if framework == "torch":
                from .writers import to_torch

                out[name] = to_torch(array, target)
            else:
                out[name] = array.view(bf16_view) if target == "bfloat16" else array
    except OSError as exc:
        raise FileUnreadable(source, exc) from None
    finally:
        for fh in handles.values():
            fh.close()
    return out

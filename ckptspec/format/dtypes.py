"""Manifest dtype names for torch dtypes, without importing torch."""

from __future__ import annotations

from .rules import ITEMSIZE


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; refuses dtypes the format does not name."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {dtype} has no name in manifest format 1.0")
    return name

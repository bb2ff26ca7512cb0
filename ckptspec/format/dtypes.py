"""The dtypes format 1.0 names: their sizes, the names of torch dtypes (without importing
torch), and the output dtypes a reconstruction accepts."""

from __future__ import annotations

from typing import Any

# Bytes per element of every dtype the schema allows (docs/spec.md has the same table).
ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}  # fmt: skip
# Cast to the output dtype by a reconstruction; integer and bool tensors keep theirs.
FLOATING = ("float64", "float32", "float16", "bfloat16")
# --dtype / dtype= spellings -> the dtype written.
OUTPUT_DTYPES = {
    "fp32": "float32", "float32": "float32", "float": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
}  # fmt: skip


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; refuses dtypes the format does not name."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {dtype} has no name in manifest format 1.0")
    return name


def output_dtype(dtype: Any) -> str:
    """``"bf16"``, ``"bfloat16"`` or ``torch.bfloat16`` -> ``"bfloat16"``; refuses anything else."""
    key = str(dtype).removeprefix("torch.").lower()
    if key not in OUTPUT_DTYPES:
        raise ValueError(f"unsupported output dtype {dtype!r}; use fp32, bf16 or fp16")
    return OUTPUT_DTYPES[key]

"""The dtypes format 1.0 names: their sizes, the names of torch dtypes (without importing
torch), and the output dtypes a reconstruction accepts."""

from __future__ import annotations

from typing import Any, Literal, TypeGuard

# Every dtype the schema allows, as a type (``models.Dtype``).
Dtype = Literal[
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "int64", "int32", "int16", "int8", "uint8", "bool", "complex64", "complex128",
]  # fmt: skip

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


def is_dtype(name: object) -> TypeGuard[Dtype]:
    """A dtype the format names."""
    return isinstance(name, str) and name in ITEMSIZE


def dtype_name(dtype: Any) -> Dtype:
    """``torch.bfloat16`` -> ``"bfloat16"``; refuses dtypes the format does not name."""
    name = str(dtype).removeprefix("torch.")
    if not is_dtype(name):
        raise ValueError(f"dtype {dtype} has no name in manifest format 1.0")
    return name


def output_dtype(dtype: Any) -> str:
    """``"bf16"``, ``"bfloat16"`` or ``torch.bfloat16`` -> ``"bfloat16"``; refuses anything else."""
    key = str(dtype).removeprefix("torch.").lower()
    if key not in OUTPUT_DTYPES:
        raise ValueError(f"unsupported output dtype {dtype!r}; use fp32, bf16 or fp16")
    return OUTPUT_DTYPES[key]

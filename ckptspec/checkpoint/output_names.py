"""The names of the files ``reconstruct`` writes: a single file or Hugging Face shards and their index, in
safetensors or torch format, and ``optimizer.safetensors``. Used to sort an output directory
(``export/outputs.py``) and to spot such a file inside a checkpoint's tag directory (CK226)."""

from __future__ import annotations

import re

OUTPUT_NAME = re.compile(
    r"^(?:model(?:-\d{5}-of-\d{5})?\.safetensors|optimizer\.safetensors|pytorch_model(?:-\d{5}-of-\d{5})?\.bin"
    r"|model\.safetensors\.index\.json|pytorch_model\.bin\.index\.json)$"
)


def is_output_name(rel: str) -> bool:
    """``rel`` (a path relative to a tag directory) is named like a reconstruction's output."""
    return bool(OUTPUT_NAME.match(rel.rsplit("/", 1)[-1]))

"""Load the output of `ckptspec reconstruct` with numpy alone (no torch), e.g. to hand it to JAX.

    python examples/load_numpy.py OUTPUT_DIR

OUTPUT_DIR holds model.safetensors, or shards listed in model.safetensors.index.json.
Prints one line per tensor. From Python, ``load_arrays(OUTPUT_DIR)`` returns the arrays; for
JAX, ``jax.numpy.asarray(array)`` takes each one as it is (JAX is not needed here).

Two things a plain safetensors reader does not do for you:

* Tied weights are stored once, under their owner; the file's ``ckptspec.aliases`` metadata
  maps each alias to its owner. load_arrays puts every alias back, as the owner's own array.
* numpy has no bfloat16. A ``--dtype bf16`` output is read as its bits (uint16) and widened
  exactly to float32: a bfloat16 is the upper half of a float32. (With the ml_dtypes package,
  safetensors.numpy reads bfloat16 itself, and JAX accepts ml_dtypes' bfloat16 arrays.)
"""

import json
import sys
from pathlib import Path

import numpy as np
from safetensors import safe_open


def shard_files(output_dir: Path) -> list[Path]:
    index = output_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text("utf-8"))["weight_map"]
        return [output_dir / name for name in dict.fromkeys(weight_map.values())]
    return [output_dir / "model.safetensors"]


def bf16_as_float32(path: Path, name: str) -> np.ndarray:
    """Read a BF16 tensor's bits from the file (8-byte header length, JSON header, data) and widen them."""
    with open(path, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        entry = json.loads(fh.read(header_len))[name]
        start, end = entry["data_offsets"]
        fh.seek(8 + header_len + start)
        bits = np.frombuffer(fh.read(end - start), dtype="<u2")
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


def load_arrays(output_dir) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor, aliases included, and the ckptspec metadata (the same in every shard)."""
    arrays, metadata = {}, {}
    for path in shard_files(Path(output_dir)):
        with safe_open(path, framework="numpy") as f:
            metadata = f.metadata() or {}
            for name in f.keys():
                if f.get_slice(name).get_dtype() == "BF16":
                    arrays[name] = bf16_as_float32(path, name)
                else:
                    arrays[name] = f.get_tensor(name)
    for alias, owner in json.loads(metadata.get("ckptspec.aliases", "{}")).items():
        arrays[alias] = arrays[owner]  # one array under both names, like the tie in the model
    return arrays, metadata


def main(output_dir: str) -> None:
    arrays, metadata = load_arrays(output_dir)
    aliases = json.loads(metadata.get("ckptspec.aliases", "{}"))
    saved_as = metadata.get("ckptspec.dtype")
    widened = " (numpy has no bfloat16: widened exactly to float32)" if saved_as == "bfloat16" else ""
    stage = metadata.get("ckptspec.zero_stage")  # one ZeRO stage only for a data-parallel checkpoint
    source = f"ZeRO-{stage}" if stage is not None else "a checkpoint index's"
    tag = metadata.get("ckptspec.tag")
    print(f"{output_dir}: {len(arrays)} arrays from {source} {tag}, saved as {saved_as}{widened}")
    for name, array in arrays.items():
        note = f" (alias of {aliases[name]})" if name in aliases else ""
        print(f"  {name}: {array.dtype} {list(array.shape)}{note}")


if __name__ == "__main__":
    main(*sys.argv[1:])

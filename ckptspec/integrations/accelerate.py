"""Hugging Face ``accelerate`` with ``Accelerator(deepspeed_plugin=...)``: ``save_state`` with the manifest, and a
``load_state`` that validates what it loads first.

    from ckptspec.integrations import accelerate as ckpt

    ckpt.save_state(accelerator, "run/step100")      # instead of accelerator.save_state("run/step100")
    ckpt.load_state(accelerator, "run/step100")      # instead of accelerator.load_state("run/step100")

Under DeepSpeed, ``save_state`` has each prepared model save a tag of its own in the output directory
(``pytorch_model``, ``pytorch_model_1``, ...), beside accelerate's random states. accelerate's state hooks run
before its save and after DeepSpeed's load, so ckptspec wraps the two calls instead: the manifest is embedded into
each tag after the save (rank 0, the outcome on every rank), and each tag is validated before the load (rank 0, the
verdict broadcast: every rank raises the same findings, and DeepSpeed has read nothing).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..deepspeed.check.run import is_tag_dir
from ..deepspeed.load.verdict import same_on_every_rank
from ..errors import CheckpointInvalid, CkptspecError
from ..format.codec import Encoding
from .checks import tag_findings

__all__ = ["load_state", "save_state"]

MODEL_TAG = re.compile(r"^pytorch_model(_\d+)?$")  # accelerate's MODEL_NAME, then _<i> for the i-th model


def save_state(accelerator, output_dir=None, *, hash: bool = True, encoding: Encoding = "json", **kwargs) -> str:
    """``accelerator.save_state(output_dir, **kwargs)``, then the manifest embedded into every DeepSpeed tag it
    wrote; call it on every rank. Returns the directory saved into. Refused before saving when the accelerator
    does not run DeepSpeed (no tag to describe)."""
    _refuse_without_deepspeed(accelerator)
    location = accelerator.save_state(output_dir, **kwargs)
    same_on_every_rank(lambda: _embed_tags(Path(location), hash, encoding))
    return location


def load_state(accelerator, input_dir=None, *, verify_hashes: bool = False, **kwargs):
    """Validate every DeepSpeed tag of ``input_dir`` (rank 0, the verdict broadcast), then
    ``accelerator.load_state(input_dir, **kwargs)``; call it on every rank. ``input_dir=None``: the folder
    accelerate itself picks (automatic checkpoint naming, the highest number). Raises ``CheckpointInvalid`` with
    the same findings on every rank before anything is loaded."""
    _refuse_without_deepspeed(accelerator)
    where = Path(input_dir) if input_dir is not None else _newest_automatic(accelerator)
    same_on_every_rank(lambda: _validate_tags(where, verify_hashes))
    return accelerator.load_state(str(where), **kwargs)


def _refuse_without_deepspeed(accelerator) -> None:
    if str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)) != "DEEPSPEED":
        raise ValueError("ckptspec describes DeepSpeed checkpoints: the accelerator needs a deepspeed_plugin")


def model_tags(directory: Path) -> list[Path]:
    """The tags of the prepared models in an accelerate save directory, in model order."""
    tags = [p for p in directory.iterdir() if MODEL_TAG.match(p.name) and p.is_dir() and is_tag_dir(p)]
    return sorted(tags, key=lambda p: int(p.name.rsplit("_", 1)[1]) if p.name != "pytorch_model" else 0)


def _embed_tags(directory: Path, hash: bool, encoding: Encoding) -> list[str]:
    from ..deepspeed.embed import embed_checkpoint

    tags = model_tags(directory)
    if not tags:
        hint = "check the accelerator's deepspeed_plugin"
        raise CkptspecError("CK901", "accelerate saved no DeepSpeed tag here", hint, str(directory))
    for tag in tags:
        algorithm = "sha256" if hash else None
        # rehash: a save into a directory saved before replaces the files its sidecar describes
        embed_checkpoint(directory, tag=tag.name, hash_algorithm=algorithm, encoding=encoding, rehash=True)
    return [tag.name for tag in tags]


def _validate_tags(directory: Path, verify_hashes: bool) -> None:
    tags = model_tags(directory) if directory.is_dir() else []
    if not tags:
        hint = "pass a directory accelerate's save_state wrote with a deepspeed_plugin"
        raise CkptspecError("CK260", "no DeepSpeed tag of accelerate's models here", hint, str(directory))
    for tag in tags:
        findings = tag_findings(directory, tag.name, verify_hashes)
        if findings:
            raise CheckpointInvalid(findings, str(tag))


def _newest_automatic(accelerator) -> Path:
    """The folder ``load_state()`` without a directory loads: the highest-numbered under ``PROJECT/checkpoints``."""
    if not accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError("load_state without input_dir needs automatic checkpoint naming")
    root = Path(accelerator.project_dir) / "checkpoints"
    numbered = [(int(m[-1]), root / name) for name in os.listdir(root) if (m := re.findall(r"(\d+)", name))]
    return max(numbered)[1]

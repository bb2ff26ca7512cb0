"""What older DeepSpeed versions wrote differently, read from the files' own ``ds_version``.

Each rule here names the version range it comes from (found with ``git log -S`` on DeepSpeed's
sources, ``../shared/notes/reviews/format-coverage-review.md`` section 1.8); a checkpoint outside
the range is read as DeepSpeed 0.10-0.19 writes it.
"""

from __future__ import annotations

import re
from pathlib import Path

from ...checkpoint.torchfile import TensorRef
from ...errors import UnsupportedCheckpoint
from ...location import RemotePath

_VERSION = re.compile(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: object) -> tuple[int, int, int] | None:
    """``"0.6.5+abc"`` -> (0, 6, 5); None when ``text`` does not start with a version number."""
    m = _VERSION.match(str(text)) if text is not None else None
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def saved_stage(file_stage: int, config_stage: object, ds_version: object) -> int:
    """The ZeRO stage of the run. DeepSpeed 0.5.9 to 0.6.7 write ``zero_stage`` 2 in every
    optimizer file of the unified ``stage_1_and_2.py``, stage-1 runs included (fixed in 0.7.0);
    their ``ds_config`` says 1. Any other disagreement is the files' (CK211 reports it)."""
    version = parse_version(ds_version)
    if file_stage == 2 and str(config_stage) == "1" and version is not None and (0, 5, 9) <= version < (0, 7, 0):
        return 1
    return file_stage


def frozen_shapes_unrecorded(model_state: dict) -> bool:
    """DeepSpeed before 0.9.1 has no ``frozen_param_shapes`` key at all (PR #3205); 0.9.1 and
    later write it, as None when ``exclude_frozen_parameters`` dropped the frozen weights. So only
    a present None means "excluded"."""
    return "frozen_param_shapes" not in model_state


def frozen_excluded(model_state: dict) -> bool:
    """``exclude_frozen_parameters`` was set: DeepSpeed >= 0.9.1 wrote ``frozen_param_shapes`` None."""
    return not frozen_shapes_unrecorded(model_state) and model_state["frozen_param_shapes"] is None


def refuse_shapes_in_optimizer_files(model_state: dict, optim_state: object, path: Path | RemotePath) -> None:
    """DeepSpeed 0.5.10 and older keep ``param_shapes`` and ``ds_version`` at the top level of
    each optimizer file, not in the model states (moved by PR #1732, in 0.6.0): named as such,
    not as "is this a DeepSpeed checkpoint?"."""
    if "param_shapes" not in model_state and isinstance(optim_state, dict) and "param_shapes" in optim_state:
        version = optim_state.get("ds_version", "0.5.10 or older")
        raise UnsupportedCheckpoint(
            f"a DeepSpeed {version} checkpoint: 'param_shapes' is in the optimizer files, not the model states",
            "ckptspec's producers read the layout of DeepSpeed 0.6 and later; load it and save it once "
            "with a newer DeepSpeed (the partition layout is the same)",
            str(path),
        )


def refuse_lost_frozen(model_state: dict, taken: set[str], path: Path | RemotePath) -> None:
    """Stage 3 before DeepSpeed 0.9.1 saved frozen parameters as empty placeholders only: their
    weights are not in the checkpoint, and nothing says so (it is not exclude_frozen_parameters).
    ``taken``: the trainable and tied names."""
    taken = taken | set(model_state.get("buffer_names") or [])
    module = model_state.get("module") or {}
    lost = [n for n, ref in module.items() if n not in taken and isinstance(ref, TensorRef)]
    if lost:
        version = model_state.get("ds_version", "< 0.9.1")
        raise UnsupportedCheckpoint(
            f"frozen parameter(s) {', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''} were not saved: "
            f"DeepSpeed {version} writes no frozen_param_shapes/fragments at stage 3",
            "their weights are not in this checkpoint (DeepSpeed 0.9.1 and later save them); "
            "take them from the model's initial weights",
            str(path),
        )

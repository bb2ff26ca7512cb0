"""Live engines the save hook cannot describe, refused before DeepSpeed writes anything.

Reads only the engine's own accessors and configuration (no torch, no DeepSpeed import), so the
refusal costs nothing and happens on every rank alike.
"""

from __future__ import annotations

from ...errors import UnsupportedEngine


def _call(engine, name: str) -> object:
    method = getattr(engine, name, None)
    return method() if callable(method) else None


def _zero_config(engine):
    return getattr(getattr(engine, "_config", None), "zero_config", None)


def _device(offload) -> str:
    device = getattr(offload, "device", None)
    return str(getattr(device, "value", device) or "")


def refuse_unsaveable(engine) -> None:
    """Engines whose saved files a manifest cannot describe, each named by its feature:

    * NVMe offload: the fp32 masters and moments of swapped sub-groups are 0-element placeholders
      in the ``.pt`` files and live in raw swap files (``offloaded_tensors/rank<NN>/``) that no
      saved file maps to their sub-groups;
    * ZeRO++ quantized non-trainable weights: the frozen fragments are int8 codes saved without
      their scales;
    * AutoEP: experts partitioned natively by ZeRO-3 (no expert files; ``ds_autoep_layers``).
    """
    zero = _zero_config(engine)
    if _call(engine, "zero_nvme_offload_optimizer") or _device(getattr(zero, "offload_optimizer", None)) == "nvme":
        raise UnsupportedEngine(
            "NVMe optimizer offload (offload_optimizer.device: nvme): the swapped masters and moments are in "
            "raw swap files that no checkpoint file locates; save without NVMe offload to get a manifest"
        )
    if _device(getattr(zero, "offload_param", None)) == "nvme":
        raise UnsupportedEngine(
            "NVMe parameter offload (offload_param.device: nvme): the swapped parameters are not in the "
            "checkpoint files; save without NVMe offload to get a manifest"
        )
    if _call(engine, "zero_quantized_nontrainable_weights"):
        raise UnsupportedEngine(
            "ZeRO++ zero_quantized_nontrainable_weights: DeepSpeed saves the frozen weights as int8 codes "
            "without their scales, which no reader can turn back into weights"
        )
    autoep = getattr(getattr(engine, "_config", None), "expert_parallel_config", None)
    if getattr(autoep, "enabled", False):
        raise UnsupportedEngine(
            "AutoEP (expert_parallel.enabled): its experts are partitioned by ZeRO-3 without expert files; "
            "ckptspec describes DeepSpeed's native MoE layers only"
        )

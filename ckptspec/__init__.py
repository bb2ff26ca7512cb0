"""ckptspec: self-describing manifests for sharded training checkpoints.

The core (models, schema, validation) needs neither torch nor DeepSpeed;
``ckptspec.deepspeed`` and ``ckptspec.torch`` import them on use.
"""

from ._version import __version__
from .errors import (
    CheckpointInvalid,
    CkptspecError,
    FileUnreadable,
    InputOutputError,
    InternalError,
    InvalidCheckpoint,
    InvalidDocument,
    InvalidManifest,
    NoValidTag,
    RemoteError,
    Unsupported,
    UnsupportedCheckpoint,
    UnsupportedEngine,
)
from .findings import Finding
from .format.dcp_validate import DcpReport
from .format.documents import load, load_manifest, validate, validate_document, validate_file
from .format.index_validate import IndexReport
from .format.validate import Report
from .format.version import FORMAT_NAME, FORMAT_VERSION

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointInvalid",
    "CkptspecError",
    "FileUnreadable",
    "Finding",
    "CheckpointIndex",
    "DcpDocument",
    "DcpReport",
    "DeepSpeedReader",
    "IndexReport",
    "InputOutputError",
    "InternalError",
    "InvalidCheckpoint",
    "InvalidDocument",
    "InvalidManifest",
    "NoValidTag",
    "RemoteError",
    "Unsupported",
    "UnsupportedCheckpoint",
    "UnsupportedEngine",
    "Manifest",
    "Report",
    "describe",
    "describe_dcp",
    "export_dcp",
    "export_universal",
    "load",
    "load_manifest",
    "load_optimizer_state",
    "load_state_dict",
    "open",
    "reconstruct",
    "reshard",
    "validate",
    "validate_checkpoint",
    "validate_document",
    "validate_file",
    "__version__",
]


# Lazy, so `import ckptspec` stays light: the models load pydantic, which `ckptspec validate MANIFEST`
# does not need; reading checkpoints loads numpy. Public name -> the module that defines it.
_LAZY = {
    "Manifest": "ckptspec.format.models",
    "CheckpointIndex": "ckptspec.format.index_models",
    "DcpDocument": "ckptspec.format.dcp_models",
    "describe": "ckptspec.deepspeed.describe",
    "describe_dcp": "ckptspec.checkpoint.dcp.describe",
    "Checkpoint": "ckptspec.export.checkpoint",
    "open": "ckptspec.export.api",
    "validate_checkpoint": "ckptspec.export.api",
    "load_state_dict": "ckptspec.export.api",
    "load_optimizer_state": "ckptspec.export.api",
    "reconstruct": "ckptspec.export.api",
    "reshard": "ckptspec.export.api",
    "export_dcp": "ckptspec.export.api",
    "export_universal": "ckptspec.export.api",
    "DeepSpeedReader": "ckptspec.export.dcp_reader",  # needs torch
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ckptspec' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(_LAZY[name]), name)

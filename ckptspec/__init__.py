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
    RemoteError,
    Unsupported,
    UnsupportedCheckpoint,
    UnsupportedEngine,
)
from .findings import Finding
from .format.documents import load, load_manifest, validate, validate_document, validate_file
from .format.index_validate import IndexReport
from .format.validate import Report
from .format.version import FORMAT_NAME, FORMAT_VERSION

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CheckpointInvalid",
    "CkptspecError",
    "FileUnreadable",
    "Finding",
    "CheckpointIndex",
    "IndexReport",
    "InputOutputError",
    "InternalError",
    "InvalidCheckpoint",
    "InvalidDocument",
    "InvalidManifest",
    "RemoteError",
    "Unsupported",
    "UnsupportedCheckpoint",
    "UnsupportedEngine",
    "Manifest",
    "Report",
    "describe",
    "load",
    "load_manifest",
    "load_optimizer_state",
    "load_state_dict",
    "reconstruct",
    "validate",
    "validate_document",
    "validate_file",
    "__version__",
]


def __getattr__(name: str):
    # Lazy, so `import ckptspec` stays light: the models load pydantic,
    # which `ckptspec validate MANIFEST` does not need; reconstruction loads numpy.
    if name == "Manifest":
        from .format.models import Manifest

        return Manifest
    if name == "CheckpointIndex":
        from .format.index_models import CheckpointIndex

        return CheckpointIndex
    if name == "describe":
        from .deepspeed.describe import describe

        return describe
    if name == "load_state_dict":
        from .export.api import load_state_dict

        return load_state_dict
    if name == "reconstruct":
        from .export.api import reconstruct

        return reconstruct
    if name == "load_optimizer_state":
        from .export.api import load_optimizer_state

        return load_optimizer_state
    raise AttributeError(f"module 'ckptspec' has no attribute {name!r}")

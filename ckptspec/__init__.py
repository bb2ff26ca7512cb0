"""ckptspec: self-describing manifests for sharded training checkpoints.

The core (models, schema, validation) needs neither torch nor DeepSpeed;
``ckptspec.deepspeed`` and ``ckptspec.torch`` import them on use.
"""

from .findings import Finding
from .format_version import FORMAT_NAME, FORMAT_VERSION
from .validate import InvalidManifest, Report, load_manifest, validate_document, validate_file

__version__ = "0.1.0.dev0"

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Finding",
    "InvalidManifest",
    "Manifest",
    "Report",
    "load_manifest",
    "load_state_dict",
    "validate_document",
    "validate_file",
    "__version__",
]


def __getattr__(name: str):
    # Lazy, so `import ckptspec` stays light: the models load pydantic (about 0.2 s),
    # which `ckptspec validate MANIFEST` does not need; reconstruction loads numpy.
    if name == "Manifest":
        from .models import Manifest

        return Manifest
    if name == "load_state_dict":
        from .reconstruct import load_state_dict

        return load_state_dict
    raise AttributeError(f"module 'ckptspec' has no attribute {name!r}")

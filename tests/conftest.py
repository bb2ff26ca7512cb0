import importlib.util
import sys
from pathlib import Path

# Make `ckptspec` importable when pytest runs from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# pytest puts this folder on sys.path (for `_harness`), where the folder `deepspeed/` (tests, no
# __init__.py) would be imported as the package `deepspeed` if DeepSpeed is missing: a test would
# then fail far away ("module 'deepspeed' has no attribute '__version__'") instead of at the import.
_spec = importlib.util.find_spec("deepspeed")
if _spec is not None and _spec.origin is None:  # a namespace package: a folder, not DeepSpeed
    sys.modules["deepspeed"] = None  # `import deepspeed` raises ModuleNotFoundError, as without this folder

pytest_plugins = ["_harness.plugin"]

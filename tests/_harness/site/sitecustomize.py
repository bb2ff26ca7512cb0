"""Test-only: skip DeepSpeed's shm comm op in every process the test jobs start.

DeepSpeed's CPU backend JIT-compiles a C++ shared-memory all-reduce (``build_shm_op``) in
``init_distributed``: about a minute of both cores on a fresh machine, plus a compiler probe of
every op on each launch. Only ``inference_all_reduce`` uses it; training, saving and loading
checkpoints go through gloo either way, so nothing the tests check depends on it.

The harness puts this folder on PYTHONPATH for its torchrun launches and for the examples it
runs (Python imports ``sitecustomize`` at start-up); the patch is applied when
``deepspeed.comm.torch`` is first imported.
"""

import importlib.abc
import importlib.util
import sys

_TARGET = "deepspeed.comm.torch"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            module.build_shm_op = lambda: None

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchOnImport())

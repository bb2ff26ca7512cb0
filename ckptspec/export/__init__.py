"""Consolidated weights from a validated checkpoint: the byte plan, dtype conversion, safetensors
and torch writers, and the public loading API.

The only layer that uses numpy, torch, safetensors, ml_dtypes and tqdm, each imported lazily
where it is needed.
"""

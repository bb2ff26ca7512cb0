"""The manifest format in code: versions, dtypes, models, schemas, codec, partition arithmetic,
semantic rules, validation and migrations.

Pure Python plus pydantic, jsonschema(-rs) and msgpack: never torch, numpy, DeepSpeed, click
or rich. Everything else in ckptspec builds on this layer.
"""

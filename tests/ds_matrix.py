"""The real-DeepSpeed checkpoint matrix shared by the producer, validation and reconstruction tests.

Each entry: an id, a harness spec (tests/dsharness/train.py) and a world size.
"""

HOOK = "ds_hooks:record_engine_manifest"
FEATURES = {"tied": True, "frozen": True, "buffers": True, "hook": HOOK}

MATRIX = {
    "s2-bf16-ws2": ({"stage": 2, "dtype": "bf16", **FEATURES}, 2),
    "s1-fp16-ws2": ({"stage": 1, "dtype": "fp16", **FEATURES}, 2),
    "s1-bf16-ws2": ({"stage": 1, "dtype": "bf16", **FEATURES}, 2),
    "s1-fp32-ws3-rr": ({"stage": 1, "dtype": "fp32", "round_robin": True, **FEATURES}, 3),
    "s2-fp16-ws2-groups": ({"stage": 2, "dtype": "fp16", "two_groups": True, **FEATURES}, 2),
    "s2-fp32-ws3-rr": ({"stage": 2, "dtype": "fp32", "round_robin": True, **FEATURES}, 3),
    "s2-bf16-ws2-align": ({"stage": 2, "dtype": "bf16", "parameter_alignment": True, **FEATURES}, 2),
    "s2-fp16-ws3-align": ({"stage": 2, "dtype": "fp16", "parameter_alignment": True, **FEATURES}, 3),
    "s2-bf16-ws2-exclude": ({"stage": 2, "dtype": "bf16", "exclude_frozen": True, **FEATURES}, 2),
    "s2-bf16-ws2-zero-elem": ({"stage": 2, "dtype": "bf16", "zero_elem": True, **FEATURES}, 2),
    "s2-bf16-ws1": ({"stage": 2, "dtype": "bf16", **FEATURES}, 1),
    "s2-bf16-ws4": ({"stage": 2, "dtype": "bf16", **FEATURES}, 4),
    "s3-bf16-ws2-sub": ({"stage": 3, "dtype": "bf16", "sub_group_size": 300, **FEATURES}, 2),
    "s3-fp16-ws3-groups": ({"stage": 3, "dtype": "fp16", "two_groups": True, **FEATURES}, 3),
    "s3-fp32-ws2-exclude": ({"stage": 3, "dtype": "fp32", "exclude_frozen": True, **FEATURES}, 2),
    "s1-bf16-ws2-bf16opt": ({"stage": 1, "dtype": "bf16", "grad_accum_dtype": "fp32", **FEATURES}, 2),
}

# Refused with a clear message, never described wrongly.
UNSUPPORTED = {
    "s0-bf16-ws1": ({"stage": 0, "dtype": "bf16", "tied": True}, 1),
}

# Written by an older DeepSpeed (tests/dsharness/build.py OLD_DEEPSPEED_VERSION): no
# param_alignment_paddings, a pickled set in the model states.
OLD_DEEPSPEED = {
    "old-s1-bf16-ws2": ({"stage": 1, "dtype": "bf16", **FEATURES}, 2),
    "old-s2-fp32-ws2-groups": ({"stage": 2, "dtype": "fp32", "two_groups": True, **FEATURES}, 2),
    "old-s3-bf16-ws2": ({"stage": 3, "dtype": "bf16", **FEATURES}, 2),
}

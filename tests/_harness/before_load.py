"""What a target job's model holds before ``engine.load_checkpoint``: values no checkpoint holds (issue #40).

A target job builds its model with the source job's seed, so its frozen parameters are already the source's (they
never train) and its buffers the source's initial ones: a frozen parameter or buffer that the load did not replace
would still look loaded. ``unlike_any_checkpoint`` fills each frozen parameter and each persistent buffer with
seeded noise first (``SEED``, the name: the same on every rank), so that only a load can give the source's values
back. Trainable parameters are left as built: they train, and the load replaces their masters and weights.

Called by the reshard and optim target jobs (reshard_job.py, optim_job.py) between ``deepspeed.initialize`` and
``engine.load_checkpoint``; keyed with them (tasks.py). ``keep_frozen``: where nothing the job loads holds a frozen
parameter, the job's own are what it resumes with (as a user's job would): a checkpoint saved with
``exclude_frozen_parameters``, and a universal folder (DeepSpeed 0.19.8's ``load_universal`` never loads the module:
``_load_checkpoint`` skips ``load_module_state_dict``, so its buffers keep these values too, which the tests assert).
"""

import zlib

SEED = 7070


def unlike_any_checkpoint(module, keep_frozen: bool = False) -> None:
    """Collective at ZeRO-3: the frozen parameters are gathered, filled on every rank, rank 0's partitioned again."""
    import deepspeed
    import torch

    frozen = [] if keep_frozen else [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
    with torch.no_grad():
        with deepspeed.zero.GatheredParameters([p for _, p in frozen], modifier_rank=0):
            for name, p in frozen:
                p.copy_(noise(name, p))
        for name, buffer in _persistent_buffers(module):
            buffer.copy_(noise(name, buffer))


def _persistent_buffers(module):
    """(name, buffer) of the buffers a state dict saves (not the ``persistent=False`` ones)."""
    for prefix, sub in module.named_modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if name not in sub._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buffer


def noise(name: str, like):
    """Seeded values of ``like``'s shape and dtype, far from a trained or initial value (and integers from zero)."""
    import torch

    generator = torch.Generator().manual_seed(SEED + zlib.crc32(name.encode()))
    if like.is_floating_point():
        return (10 + torch.randn(like.shape, generator=generator)).to(like.dtype)
    return torch.randint(100, 1000, like.shape, generator=generator).to(like.dtype)

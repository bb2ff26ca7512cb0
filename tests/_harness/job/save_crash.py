"""Task "save_crash": ``ckptspec.deepspeed.save_checkpoint`` killed at a chosen step.

``args``: ``spec`` (model.DEFAULTS), ``second_tag`` (the tag of the second save: ``"first"``
again, or a new one), ``kill_at`` (the step of the second save at which rank 0 sends itself
SIGKILL, or null to let it finish). The job saves tag ``first`` completely, trains one more step,
then saves ``second_tag`` with every file write counted: ckptspec's own (``ckptspec._fs``
io points) and DeepSpeed's (each ``checkpoint_engine.save`` call, wrapped here). Without a kill,
rank 0 writes ``steps.json`` (how many steps the second save took) and then loads each saved
tag back with ``engine.load_checkpoint``, recording in ``loads.json`` that the fp32 masters
come back exactly as saved (so both complete states a kill may leave are known loadable).
"""

import itertools
import json
import types
import uuid
from pathlib import Path

from _harness.job.model import SEQ, VOCAB, live_fp32, normalize_spec
from _harness.job.train import train_engine


def _step(engine, spec, salt):
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(spec["seed"] + salt + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (spec["micro_batch"], SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (spec["micro_batch"], SEQ), generator=g)
    loss = engine(tokens, targets)
    engine.backward(loss)
    engine.step()


def _same(a, b):
    import torch

    return sorted(a) == sorted(b) and all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


def run(args, out: Path):
    import torch
    import torch.distributed as dist

    import ckptspec._fs as fs
    import ckptspec.deepspeed.save.zero as hook
    from ckptspec.deepspeed import save_checkpoint

    spec, second, kill_at = normalize_spec(args["spec"]), args["second_tag"], args["kill_at"]
    # Save ids are random; number them instead, so that the killed run and the complete one write
    # the same bytes and a tag left by a kill can be compared with the complete run's byte for byte.
    ids = itertools.count(1)
    hook.uuid = types.SimpleNamespace(uuid4=lambda: uuid.UUID(int=next(ids)))
    rank = dist.get_rank()
    engine, model = train_engine(spec)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(engine, str(out), tag="first")
    first = live_fp32(engine, model, spec["stage"])
    _step(engine, spec, 500)
    saved = live_fp32(engine, model, spec["stage"])

    # Count (and, on rank 0, stop at) every write of the second save, DeepSpeed's included.
    checkpoint_engine = engine.checkpoint_engine
    deepspeed_save = checkpoint_engine.save

    def counted_save(state_dict, path):
        fs.io_point("deepspeed-save")
        return deepspeed_save(state_dict, path)

    checkpoint_engine.save = counted_save
    fs._FAILPOINT = f"kill:{kill_at}" if kill_at and rank == 0 else "count"
    fs._steps = 0
    save_checkpoint(engine, str(out), tag=second)
    steps = fs._steps
    fs._FAILPOINT = ""
    checkpoint_engine.save = deepspeed_save
    dist.barrier()
    if kill_at:
        raise RuntimeError(f"the second save passed step {kill_at} without being killed ({steps} steps)")

    loads = {}
    for tag, expected in ((second, saved), ("first", first if second != "first" else saved)):
        _step(engine, spec, 900)  # move away, so a load that does nothing cannot pass
        engine.load_checkpoint(str(out), tag=tag)
        loads[tag] = _same(live_fp32(engine, model, spec["stage"]), expected)
    if rank == 0:
        (out / "steps.json").write_text(json.dumps({"steps": steps}))
        (out / "loads.json").write_text(json.dumps(loads))
        torch.save({"first": first, "second": saved}, out / "masters.pt")
    dist.barrier()
    if hasattr(engine, "destroy"):
        engine.destroy()

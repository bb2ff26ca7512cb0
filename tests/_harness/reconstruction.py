"""The main oracle of reconstruction, shared by every test that reconstructs a real checkpoint:
``ckptspec reconstruct`` output against DeepSpeed's ``zero_to_fp32``, the live engine's fp32
masters recorded in the job (``live_fp32.pt``) and the model-states files read with torch."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner


def bits(tensor):
    """The raw bytes of a tensor, for exact comparison (NaN == NaN, -0.0 != 0.0)."""
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(ours, theirs) -> bool:
    import torch

    if theirs.is_floating_point() and theirs.dtype != ours.dtype:
        theirs = theirs.to(ours.dtype)  # only ever a widening here (bf16/fp16 -> fp32): exact
    return ours.dtype == theirs.dtype and torch.equal(bits(ours), bits(theirs))


def cli(*args: str):
    """A ckptspec command in-process; asserts it exited 0 (the process boundary is tested elsewhere)."""
    from ckptspec.cli import cli as command

    result = CliRunner().invoke(command, [str(a) for a in args])
    assert result.exit_code == 0, (result.output, result.exc_info)
    return result


def invoke(*args):
    """A ckptspec command in-process, whatever its exit code (a refusal is a result to check); anything it raises
    but SystemExit fails the test: a user never gets a traceback."""
    from ckptspec.cli import cli as command

    result = CliRunner().invoke(command, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def roles(save_dir: Path) -> dict[str, str]:
    from ckptspec.deepspeed.describe import describe

    m = describe(save_dir)
    out = {p.name: "trainable" for g in m.groups for p in g.params}
    out |= {f.name: "frozen" for f in m.frozen} | {b.name: "buffer" for b in m.buffers}
    return out | {a.name: "alias" for a in m.aliases}


def check_reconstruction(
    save_dir: Path, out: Path, zero_to_fp32, *, stage: int, zero_to_fp32_reads_it: bool = True
) -> None:
    """Reconstruct ``save_dir`` into ``out`` and compare every tensor with DeepSpeed's answers
    (``zero_to_fp32``: the test's fixture, which marks it ``deepspeed``).

    ``zero_to_fp32_reads_it``: False where DeepSpeed's own tool refuses the checkpoint
    (BF16_Optimizer); the refusal itself is then asserted.
    """
    import safetensors.torch
    import torch

    from ckptspec.deepspeed.layout.tag_dir import resolve_tag_dir
    from ckptspec.export.api import load_consolidated

    cli("reconstruct", save_dir, out, "--quiet")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    stored = safetensors.torch.load_file(out / "model.safetensors")
    full = load_consolidated(out)  # aliases re-tied from the metadata
    expected_roles = roles(save_dir)
    assert sorted(full) == sorted(expected_roles), (
        "every module key (trainable, frozen, buffer, alias) is in the output"
    )
    assert sorted(stored) == sorted(n for n, r in expected_roles.items() if r != "alias"), (
        "tied weights are stored once"
    )

    if zero_to_fp32_reads_it:
        reference = zero_to_fp32(save_dir)
    else:
        try:
            zero_to_fp32(save_dir)
        except ValueError as exc:  # DeepSpeed's zero_to_fp32 cannot read BF16_Optimizer checkpoints
            assert "is not a zero checkpoint" in str(exc)
        else:
            raise AssertionError("zero_to_fp32 read a checkpoint it was expected to refuse")
        reference = {}
    compared = 0
    for key, theirs in reference.items():
        ours = full[key]
        if theirs.numel() == 0:
            # zero_to_fp32 gives zero-element params the shape (0,) (false tie through data_ptr 0).
            assert ours.numel() == 0, key
            continue
        assert ours.shape == theirs.shape, key
        assert same_bits(ours, theirs), f"{key} differs from zero_to_fp32"
        if theirs.is_floating_point():
            assert ours.dtype == torch.float32
        compared += 1
    assert compared or not zero_to_fp32_reads_it, "zero_to_fp32 returned nothing to compare"

    live = torch.load(save_dir / "live_fp32.pt", weights_only=True)
    assert live, "the harness recorded the live fp32 masters"
    for key, theirs in live.items():
        assert expected_roles[key] in ("trainable", "alias")
        assert same_bits(full[key], theirs), f"{key} differs from the live engine's fp32 master"

    # Frozen params and buffers: exactly the model-states values (widened to fp32).
    tag_dir = resolve_tag_dir(save_dir)
    model_files = [
        torch.load(p, map_location="cpu", weights_only=False) for p in sorted(tag_dir.glob("*model_states.pt"))
    ]
    module = model_files[0]["module"]
    for key, role in expected_roles.items():
        if role == "buffer" or (role == "frozen" and stage < 3):
            assert same_bits(full[key], module[key].view(full[key].shape)), key
        elif role == "frozen":  # stage 3: each rank's fragment, concatenated and trimmed
            whole = torch.cat([states["frozen_param_fragments"][key] for states in model_files])
            assert same_bits(full[key], whole[: full[key].numel()].view(full[key].shape)), key

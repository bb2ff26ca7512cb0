"""A live pipeline stage's manifest as the directory producer reads the stage's files (the save hook's
index must equal ``generate``'s): frozen parameters and buffers are keys of the layer files, not of the
domain manifest; what ``generate`` refuses in a stage (a tie inside it, frozen parameters DeepSpeed also
saves in ``frozen_param_fragments`` at ZeRO-2) is refused before anything is written.

The manifest is the committed real ZeRO-2 checkpoint's (a tie, frozen parameters, buffers), each rule
tried on a copy with only its feature left."""

import pytest

import ckptspec
from ckptspec.deepspeed.live.model_parallel import as_pipeline_stage
from ckptspec.errors import UnsupportedEngine


@pytest.fixture
def manifest(committed):
    found = ckptspec.describe(committed("s2-bf16-ws2"))
    assert found.aliases and found.frozen and found.buffers and found.layout.zero_stage == 2
    return found


def test_a_tie_inside_one_stage_is_refused(manifest):
    with pytest.raises(UnsupportedEngine, match="a tie inside one pipeline stage"):
        as_pipeline_stage(manifest)


def test_frozen_parameters_of_a_zero2_pipeline_are_refused(manifest):
    manifest.aliases = []
    with pytest.raises(UnsupportedEngine, match="frozen_param_fragments"):
        as_pipeline_stage(manifest)


def test_a_zero1_stage_leaves_its_frozen_parameters_and_buffers_to_the_layer_files(manifest):
    manifest.aliases, manifest.layout.zero_stage = [], 1
    groups = [g.model_copy(deep=True) for g in manifest.groups]
    as_pipeline_stage(manifest)
    assert (manifest.frozen, manifest.buffers) == ([], []) and manifest.groups == groups

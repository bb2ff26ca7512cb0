"""What every save hook asks DeepSpeed to save: the user's client state, never with ckptspec's own key
(the embedded manifest lives there), and DeepSpeed's default tag when none is given."""

from types import SimpleNamespace

import pytest

from ckptspec.checkpoint.embedded import CLIENT_STATE_KEY
from ckptspec.deepspeed.save.protocol import save_request

ENGINE = SimpleNamespace(global_steps=7)  # the one attribute the request reads


def test_the_default_tag_is_deepspeeds():
    assert save_request(ENGINE, None, None) == ({}, "global_step7")
    assert save_request(ENGINE, {"epoch": 3}, 12) == ({"epoch": 3}, "12")


def test_the_users_client_state_is_copied_not_changed():
    mine = {"epoch": 3}
    state, _ = save_request(ENGINE, mine, "t")
    state["x"] = 1
    assert mine == {"epoch": 3}


def test_ckptspecs_key_in_the_client_state_is_refused():
    with pytest.raises(ValueError, match=f"{CLIENT_STATE_KEY!r} is reserved for ckptspec"):
        save_request(ENGINE, {CLIENT_STATE_KEY: "mine"}, None)

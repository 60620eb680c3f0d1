"""The codec of state that travels in control messages (``PinReply.state``, ``Handoff.state``): tensors only."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from nebula_engine.cluster.runtime.worker_codec import state_bytes, state_from_bytes


class _Exploit:
    def __reduce__(self):
        return (print, ("unpickled code ran",))


def test_a_state_round_trips_and_an_empty_one_is_no_bytes():
    state = {"conv": torch.arange(6.0).reshape(2, 3), "recurrent": [torch.ones(2, 2)]}
    loaded = state_from_bytes(state_bytes(state))
    assert torch.equal(loaded["conv"], state["conv"]) and torch.equal(loaded["recurrent"][0], torch.ones(2, 2))
    assert state_bytes({}) == b"" and state_from_bytes(b"") == {}


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("payload", [b"not a torch archive", pickle.dumps(_Exploit())], ids=["garbage", "pickle"])
def test_bytes_that_are_not_a_saved_tensor_dict_are_refused(payload, capsys):
    with pytest.raises(ValueError, match="malformed state bytes"):
        state_from_bytes(payload)
    assert "unpickled code ran" not in capsys.readouterr().out


def test_a_saved_object_other_than_a_dict_is_refused():
    buffer = io.BytesIO()
    torch.save([torch.zeros(1)], buffer)
    with pytest.raises(ValueError, match="not a dict"):
        state_from_bytes(buffer.getvalue())

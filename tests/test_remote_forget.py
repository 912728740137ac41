"""A state held in ranges lets go of the last parameter its owner sent once the checks that read it are done.

`RemoteState` (rank 0's view of an optimizer state held by the parameters' owners) keeps the last parameter read for a
second read of it; the verifier makes it `forget` after the reduce's reads, so that a parameter-sized copy sent by its
owner is not held over the oracle's forwards (the checks' peak on rank 0).
"""

from __future__ import annotations

import torch

from dpcompare.verify.ranks.verifier_group import Remote, RemoteState


def _state():
    sent: list[str] = []
    values = {"a": torch.ones(3), "b": torch.full((5,), 2.0)}

    def fetch(name: str) -> torch.Tensor:
        sent.append(name)
        return values[name].clone()
    remote = Remote({}, ["a", "b"], fetch, None)
    meta = {"momentum_buffer": {n: (tuple(v.shape), v.dtype) for n, v in values.items()}}
    return RemoteState({"a": {}, "b": {}}, {"momentum_buffer": remote}, meta), remote, sent


def test_a_forgotten_parameter_is_sent_again_and_one_kept_is_not():
    state, remote, sent = _state()
    first = state["b"]["momentum_buffer"]
    assert torch.equal(first, torch.full((5,), 2.0)) and sent == ["b"]
    state["b"]  # kept for a second read: not sent again
    assert sent == ["b"]
    state.forget()
    assert state._last is None and remote._last is None  # nothing of it held here
    assert torch.equal(state["b"]["momentum_buffer"], first) and sent == ["b", "b"]  # read again: sent again


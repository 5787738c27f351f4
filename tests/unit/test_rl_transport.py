"""A batch of experience crosses a real socket as one payload and comes back field for field;
a layout that does not fit its payload is refused."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from replicator.ps.messages import Connection, MessageFormatError, text_tensor
from replicator.rl import transport as T

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair():
    left, right = socket.socketpair()
    sender, receiver = Connection(left, "actor 0", 30), Connection(right, "learner 0", 30)
    yield sender, receiver
    sender.close()
    receiver.close()


def test_a_batch_of_mixed_dtypes_arrives_field_for_field(pair):
    sender, receiver = pair
    items = {  # odd sizes, so that fields after them need the payload's alignment
        "obs": torch.randn(5, 3),
        "terminated": torch.tensor([True, False, True, False, False]),
        "action": torch.arange(5),
        "reward": torch.randn(5, dtype=torch.float64),
        "frames": torch.randint(0, 255, (5, 1, 3), dtype=torch.uint8),
        "logp": torch.randn(5, dtype=torch.float16),
    }
    T.send_items(sender, items, version=7, steps=40, round_=2, returns=[1.5], total_steps=80)
    head = receiver.receive()
    assert (head.kind, head.version, head.a, head.b) == (T.ITEMS, 7, 40, 2)
    got = T.receive_items(receiver, head.c, "receiving experience")
    assert list(got) == list(items)
    for name, value in items.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    episodes = receiver.receive()
    assert episodes.kind == T.EPISODES and episodes.payload.tolist() == [1.5]


def test_a_layout_beyond_its_payload_is_refused(pair):
    sender, receiver = pair
    layout = [["obs", 0, [4, 4], 0]]  # 64 bytes of float32 announced, 16 sent
    sender.send_many([(T.ITEMS, -1, 0, None, 4, 0, 2),
                      (T.PART, 0, 0, text_tensor(json.dumps(layout)), 0, 0, 0),
                      (T.PART, 1, 0, torch.zeros(16, dtype=torch.uint8), 0, 0, 0)])
    head = receiver.receive()
    with pytest.raises(MessageFormatError, match="field 'obs' at bytes 0..64 of a payload of 16"):
        T.receive_items(receiver, head.c, "receiving experience")


def test_experience_in_the_old_one_part_per_field_form_is_refused(pair):
    sender, receiver = pair
    sender.send_many([(T.ITEMS, -1, 0, None, 4, 0, 3),
                      (T.PART, 0, 0, text_tensor(json.dumps(["obs", "action"])), 0, 0, 0),
                      (T.PART, 1, 0, torch.zeros(4, 4), 0, 0, 0),
                      (T.PART, 2, 0, torch.zeros(4), 0, 0, 0)])
    head = receiver.receive()
    with pytest.raises(MessageFormatError, match="same replicator version"):
        T.receive_items(receiver, head.c, "receiving experience")

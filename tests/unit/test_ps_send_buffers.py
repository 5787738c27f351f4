"""The parameter-server connection sends a batch of message parts in as few writes as the
kernel takes: partial writes (a payload larger than the socket buffer) and more parts than one
``sendmsg`` takes must still arrive whole and in order."""

from __future__ import annotations

import socket
import threading

import torch

from replicator.ps.messages import _send_buffers


def _received(parts: list[bytes]) -> bytes:
    left, right = socket.socketpair()
    got = bytearray()
    total = sum(len(p) for p in parts)

    def read() -> None:
        while len(got) < total:
            chunk = right.recv(1 << 16)
            if not chunk:
                break
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        left.settimeout(30)
        _send_buffers(left, [memoryview(p) for p in parts])
        reader.join(30)
    finally:
        left.close()
        right.close()
    return bytes(got)


def test_a_payload_larger_than_the_socket_buffer_arrives_whole():
    big = torch.randint(0, 256, (6 << 20,), dtype=torch.uint8).numpy().tobytes()
    parts = [b"head-1", big, b"head-2", big[::-1]]
    assert _received(parts) == b"".join(parts)


def test_more_parts_than_one_write_takes_arrive_in_order():
    parts = [f"part {i};".encode() * (1 + i % 7) for i in range(1500)]
    assert _received(parts) == b"".join(parts)


def test_messages_read_ahead_arrive_whole_whatever_the_pieces_the_socket_gives():
    """The receiving end reads ahead into its inbox: headers cut anywhere, payloads smaller
    and larger than the inbox's share, and a payload-less message between them all arrive."""
    from replicator.ps.messages import Connection, _as_bytes

    sizes = [0, 1, 100, (16 << 10) - 1, (16 << 10) + 1, 64 << 10, 200_000, 3]
    tensors = [torch.arange(n, dtype=torch.uint8) if n else None for n in sizes]
    left, right = socket.socketpair()
    sender, receiver = Connection(left, "sender", 30), Connection(right, "receiver", 30)
    staged = sender.stage([(7, i, 0, t, i, 0, 0) for i, t in enumerate(tensors)])
    wire = b"".join(bytes(c) if isinstance(c, bytes) else bytes(_as_bytes(c))
                    for c in staged.chunks)

    def send_in_pieces() -> None:
        at, piece = 0, 1
        while at < len(wire):  # 1, 2, 3, ... bytes, then larger writes
            left.sendall(wire[at:at + piece])
            at += piece
            piece = piece + 1 if piece < 300 else 70_001

    writer = threading.Thread(target=send_in_pieces)
    writer.start()
    try:
        for i, t in enumerate(tensors):
            msg = receiver.receive("a test message")
            assert (msg.kind, msg.var_id, msg.a) == (7, i, i)
            if t is None:
                assert msg.payload is None
            else:
                assert torch.equal(msg.payload, t)
    finally:
        writer.join(30)
        left.close()
        right.close()


def test_a_lane_carries_every_dtype_and_layout_exactly():
    """Payloads in shared memory: numpy's fast copy where it applies, torch's copy for the
    rest (bfloat16, strided, conjugate views), each read back bit for bit."""
    from replicator.comm.shm_segment import SharedSegment, unlink_segment
    from replicator.ps.messages import SharedLane

    size, first, second = SharedLane.layout(1 << 16, 1 << 16)
    mine = SharedSegment.create_named(size, "lane-dtypes")
    try:
        theirs = SharedSegment.open_named(mine.name, size)
    finally:
        unlink_segment(mine.name)
    writer = SharedLane(mine, out=first, inbox=second)
    reader = SharedLane(theirs, out=second, inbox=first)
    z = torch.randn(4, 3, dtype=torch.complex64)
    sent = [torch.randn(5, 7), torch.randn(3, dtype=torch.float64),
            torch.randn(6).to(torch.bfloat16), torch.randn(4, 6)[:, ::2],
            torch.tensor([True, False, True]), torch.arange(9, dtype=torch.int8).reshape(3, 3),
            torch.randn(2, 2, requires_grad=True), z.conj(), -torch.randn(3), torch.tensor(7)]
    offsets = writer.write(sent)
    for t, offset in zip(sent, offsets):
        got = reader.read(offset, t.numel() * t.element_size(), t.dtype, tuple(t.shape))
        assert got is not None and got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got, t.detach().resolve_conj()), t.dtype
    assert reader.read(offsets[0] + 1, 4, torch.float32, (1,)) is None  # not aligned

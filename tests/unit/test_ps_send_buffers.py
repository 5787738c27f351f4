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

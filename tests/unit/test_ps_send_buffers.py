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

"""Typed tensor messages between two processes, never pickled: a fixed int64 header, then the
payload's bytes, over one TCP connection per pair (a dead peer closes only its own). Between two
ends on one host a :class:`SharedLane` carries the payloads: a sender overwrites its outbox with
each shared batch, so only requests answered after their payloads were consumed, and their
answers, use it (docs/parameter_server.md, "Transport")."""

from __future__ import annotations

import math
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from replicator.comm.shm_segment import ALIGN, SharedSegment, align
from replicator.errors import ReplicatorError

MAGIC = 0x52504D5347  # "RPMSG"
MAX_DIMS = 6
HEADER_FIELDS = 18
#: Header fields: the payload's offset in the sender's shared-memory outbox (-1: on the socket).
_SHM_FIELD = 16
HEADER_BYTES = HEADER_FIELDS * 8
#: The header's layout on the wire (packed and unpacked with ``struct``: a tensor per header
#: cost ~20 us of conversions per message on each side).
_HEADER = struct.Struct(f"<{HEADER_FIELDS}q")

#: dtype <-> code on the wire (append only; codes are part of the protocol).
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
DTYPE_CODES = {dt: i for i, dt in enumerate(DTYPES)}
ITEMSIZE = {dt: torch.empty(0, dtype=dt).element_size() for dt in DTYPES}


#: Where a payload may land: ``into(kind, var_id, dtype, shape)`` returns a contiguous tensor of
#: that dtype and shape to receive into (no allocation), or ``None`` for a new one (a payload in
#: shared memory: a view of it, valid until the peer's next shared batch).
Into = Callable[[int, int, torch.dtype, tuple[int, ...]], "torch.Tensor | None"]
#: One message to send: (kind, variable id, version, payload, a, b, c).
Outgoing = tuple[int, int, int, "torch.Tensor | None", int, int, int]


@dataclass
class Staged:
    """A batch ready to go on the socket: the headers, and the payloads not in shared memory."""

    chunks: list[bytes | torch.Tensor]
    lane_bytes: int = 0


class PeerLostError(ReplicatorError, ConnectionError):
    """The process at the other end of a message connection closed it or stopped answering."""


class MessageFormatError(ReplicatorError, ValueError):
    """A message header that this version of the protocol does not understand."""


@dataclass
class Message:
    """One received message: its kind, variable id, version, three free integers, payload."""

    kind: int
    var_id: int
    version: int
    a: int
    b: int
    c: int
    payload: torch.Tensor | None


def _header(kind: int, var_id: int, version: int, tensor: torch.Tensor | None,
            a: int, b: int, c: int) -> list[int]:
    """The header's fields (packed with ``_HEADER`` when the batch is sent)."""
    head = [MAGIC, kind, var_id, version, 0, -1, 0] + [0] * MAX_DIMS + [a, b, c, -1, 0]
    if tensor is not None:
        if tensor.dtype not in DTYPE_CODES:
            raise TypeError(f"cannot send a tensor of dtype {tensor.dtype}; supported: "
                            + ", ".join(str(d) for d in DTYPES))
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"cannot send a tensor of {tensor.dim()} dimensions (at most "
                             f"{MAX_DIMS}). HINT: reshape it before sending.")
        head[4:7 + tensor.dim()] = [tensor.numel() * tensor.element_size(),
                                    DTYPE_CODES[tensor.dtype], tensor.dim(), *tensor.shape]
    return head


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """A byte view of ``tensor``'s memory (writable: receives land in place)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


#: Bytes a connection reads ahead from its socket (headers, small payloads).
_INBOX_BYTES = 64 << 10

#: Buffers handed to one ``sendmsg`` call (Linux takes at most 1024).
_MAX_BUFFERS = 512


def _send_buffers(sock: socket.socket, views: list[memoryview]) -> None:
    """Send every buffer, in order, in as few system calls as the kernel allows (with
    ``TCP_NODELAY`` each write is a packet and a wake-up of the receiver)."""
    if not hasattr(sock, "sendmsg"):  # not on every platform
        for view in views:
            sock.sendall(view)
        return
    start = 0
    while start < len(views):
        batch = views[start:start + _MAX_BUFFERS]
        sent = sock.sendmsg(batch)
        for view in batch:
            if sent < view.nbytes:  # a partial write: go on from inside this buffer
                views[start] = view[sent:]
                break
            sent -= view.nbytes
            start += 1


#: Dtypes whose payloads are copied and viewed through numpy: a slice and a view there cost
#: about a third of torch's (measured 1.3 vs 3.4-5.7 us per payload; a step moves dozens).
_NUMPY = {dt: torch.empty(0, dtype=dt).numpy().dtype for dt in (
    torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class SharedLane:
    """Regions of ``segment``: the outbox ``out`` and the inbox ``inbox``, as (offset, bytes)."""

    def __init__(self, segment: SharedSegment, out: tuple[int, int], inbox: tuple[int, int]
                 ) -> None:
        self.segment = segment
        self.out_offset, self.out_bytes = out
        self.in_offset, self.in_bytes = inbox
        self._array = segment.base.numpy()  # the same memory, for cheap slices and copies
        self._bytes = memoryview(self._array)  # type: ignore[arg-type]

    @staticmethod
    def layout(first_bytes: int, second_bytes: int) -> tuple[int, tuple[int, int], tuple[int, int]]:
        """The segment size and two regions for payloads of ``first_bytes`` (the creator's
        outbox) and ``second_bytes`` (the peer's outbox)."""
        first, second = align(max(first_bytes, ALIGN)), align(max(second_bytes, ALIGN))
        return first + second, (0, first), (first, second)

    @staticmethod
    def nbytes(tensors: Sequence[torch.Tensor | None]) -> int:
        """Outbox bytes that ``tensors`` take (each payload starts aligned)."""
        return sum(align(t.numel() * t.element_size()) for t in tensors if t is not None)

    def write(self, tensors: Sequence[torch.Tensor | None], at: int = 0) -> list[int]:
        """Copy each tensor into the outbox one after the other from ``at`` (aligned); their
        offsets there (-1 for ``None``). The caller checked that they fit."""
        offsets = []
        for t in tensors:
            if t is None:
                offsets.append(-1)
                continue
            n = t.numel() * t.element_size()
            if n:
                start = self.out_offset + at
                if t.dtype in _NUMPY and t.device.type == "cpu" and t.is_contiguous() \
                        and not (t.is_conj() or t.is_neg()):
                    source = t.detach().numpy().reshape(-1).view(np.uint8)
                    self._bytes[start:start + n] = source  # type: ignore[call-overload]
                else:
                    dst = self.segment.base[start:start + n]
                    dst.view(t.dtype).view(t.shape).copy_(t.detach())
            offsets.append(at)
            at += align(n)
        return offsets

    def read(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
             ) -> torch.Tensor | None:
        """A view of the payload at ``offset`` in the inbox (``None`` if it lies outside)."""
        if offset < 0 or offset % ALIGN or offset + nbytes > self.in_bytes:
            return None
        start = self.in_offset + offset
        np_dtype = _NUMPY.get(dtype)
        if np_dtype is None:
            return self.segment.base[start:start + nbytes].view(dtype).view(shape)
        return torch.from_numpy(self._array[start:start + nbytes].view(np_dtype).reshape(shape))


class Connection:
    """A message connection over a connected socket; ``peer`` names the other end in errors.
    ``send`` and ``receive`` may be called from different threads (one lock each way)."""

    def __init__(self, sock: socket.socket, peer: str, timeout_seconds: float) -> None:
        self.sock, self.peer, self.timeout_seconds = sock, peer, timeout_seconds
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small headers
        sock.settimeout(timeout_seconds)
        self._send_lock, self._recv_lock = threading.Lock(), threading.Lock()
        self.closed = False
        #: Bytes of messages sent and received (headers and payloads, socket or lane).
        self.bytes_sent = self.bytes_received = 0
        #: Receive buffers its owner reuses from message to message (see ``into``).
        self.buffers: dict[Any, torch.Tensor] = {}
        #: Shared memory with a peer on this host (see :class:`SharedLane`).
        self.lane: SharedLane | None = None
        #: Bytes read from the socket and not yet taken (``[_start, _end)`` of ``_inbox``): a
        #: batch's headers arrive together and are taken with one system call, not one each.
        self._inbox = bytearray(_INBOX_BYTES)
        self._inbox_view = memoryview(self._inbox)
        self._start = self._end = 0

    @classmethod
    def connect(cls, address: tuple[str, int], peer: str, timeout_seconds: float) -> Connection:
        """Open a connection to ``address``; :class:`PeerLostError` if nobody answers."""
        try:
            sock = socket.create_connection(address, timeout=timeout_seconds)
        except OSError as exc:
            raise PeerLostError(f"could not connect to {peer} at {address[0]}:{address[1]}: "
                                f"{exc}") from exc
        return cls(sock, peer, timeout_seconds)

    def send(self, kind: int, var_id: int = -1, version: int = 0,
             tensor: torch.Tensor | None = None, a: int = 0, b: int = 0, c: int = 0) -> None:
        """Send one message (the header, then the tensor's bytes)."""
        self.send_many([(kind, var_id, version, tensor, a, b, c)])

    def send_many(self, messages: list[Outgoing], shared: bool = False) -> None:
        """Send several messages back to back, under one lock (they stay contiguous);
        ``shared``: their payloads go through the lane if there is one and they fit."""
        with self._send_lock:
            self._send(self._stage(messages, shared))

    def stage(self, messages: list[Outgoing], shared: bool = False, lane_start: int = 0) -> Staged:
        """Prepare a batch for :meth:`send_staged`; with ``shared`` (and room in the lane from
        ``lane_start``) the payloads are copied into the outbox now."""
        with self._send_lock:
            return self._stage(messages, shared, lane_start)

    def send_staged(self, staged: Staged) -> None:
        """Send a batch prepared by :meth:`stage`."""
        with self._send_lock:
            self._send(staged)

    def fits_shared(self, tensors: list[torch.Tensor | None]) -> bool:
        """Whether ``tensors`` would go through the lane in one shared batch."""
        return self.lane is not None and self.lane.nbytes(tensors) <= self.lane.out_bytes

    def _stage(self, messages: list[Outgoing], shared: bool, lane_start: int = 0) -> Staged:
        heads = [_header(kind, var_id, version, tensor, a, b, c)
                 for kind, var_id, version, tensor, a, b, c in messages]
        tensors = [m[3] for m in messages]
        lane = self.lane
        if shared and lane is not None and lane_start + lane.nbytes(tensors) <= lane.out_bytes:
            for head, offset in zip(heads, lane.write(tensors, lane_start)):
                head[_SHM_FIELD] = offset
            return Staged([b"".join(_HEADER.pack(*head) for head in heads)],
                          lane_bytes=sum(t.numel() * t.element_size() for t in tensors
                                         if t is not None))
        chunks: list[bytes | torch.Tensor] = []
        for head, tensor in zip(heads, tensors):
            packed = _HEADER.pack(*head)
            if chunks and isinstance(chunks[-1], bytes):
                chunks[-1] += packed  # headers of payload-less messages travel together
            else:
                chunks.append(packed)
            if tensor is not None and tensor.numel():
                chunks.append(tensor)
        return Staged(chunks)

    def _send(self, staged: Staged) -> None:
        views = [memoryview(c) if isinstance(c, bytes) else _as_bytes(c) for c in staged.chunks]
        self.bytes_sent += staged.lane_bytes + sum(v.nbytes for v in views)
        try:
            _send_buffers(self.sock, views)
        except OSError as exc:
            raise PeerLostError(f"lost the connection to {self.peer} while sending: {exc}") from exc

    def _fill(self, need: int, what: str, timeout: float | None) -> None:
        """Read until ``need`` bytes wait in the inbox, taking whatever else has arrived too."""
        if self._end - self._start >= need:
            return
        if self._start:  # move what is left to the front
            left = self._end - self._start
            self._inbox[:left] = self._inbox[self._start:self._end]
            self._start, self._end = 0, left
        self.sock.settimeout(timeout)
        while self._end < need:
            self._end += self._recv(self._inbox_view[self._end:], what, timeout)

    def _read_into(self, view: memoryview, what: str, timeout: float | None) -> None:
        """Fill ``view`` from the inbox, then (a large payload) straight from the socket."""
        got = min(len(view), self._end - self._start)
        view[:got] = self._inbox_view[self._start:self._start + got]
        self._start += got
        rest = len(view) - got
        if 0 < rest < _INBOX_BYTES // 4:  # small: through the inbox
            self._fill(rest, what, timeout)
            view[got:] = self._inbox_view[self._start:self._start + rest]
            self._start += rest
        elif rest:
            self.sock.settimeout(timeout)
            while got < len(view):
                got += self._recv(view[got:], what, timeout)

    def _recv(self, view: memoryview, what: str, timeout: float | None) -> int:
        """One ``recv_into``: the bytes it took (at least one), or :class:`PeerLostError`."""
        try:
            n = self.sock.recv_into(view)
        except TimeoutError as exc:
            raise PeerLostError(f"{self.peer} sent nothing for {timeout:.0f} s (while {what})"
                                ) from exc
        except OSError as exc:
            raise PeerLostError(f"lost the connection to {self.peer} (while {what}): {exc}"
                                ) from exc
        if n == 0:
            raise PeerLostError(f"{self.peer} closed the connection (while {what})")
        return n

    def receive(self, what: str = "waiting for a message",
                timeout_seconds: float | None = -1.0, into: Into | None = None) -> Message:
        """Receive one message; waits at most ``timeout_seconds`` (default: the connection's;
        ``None``: no limit, for a server waiting on a client that may be idle). ``into`` may
        name where the payload lands (a tensor that matches exactly, else a new one)."""
        timeout = self.timeout_seconds if timeout_seconds == -1.0 else timeout_seconds
        with self._recv_lock:
            self._fill(HEADER_BYTES, what, timeout)
            h = list(_HEADER.unpack_from(self._inbox, self._start))
            self._start += HEADER_BYTES
            self.bytes_received += HEADER_BYTES + max(0, h[4])
            if h[0] != MAGIC:
                raise MessageFormatError(f"{self.peer} sent a message without the replicator "
                                         "header. HINT: is another program using this port?")
            payload = None
            if h[5] >= 0:
                if h[5] >= len(DTYPES) or not 0 <= h[6] <= MAX_DIMS:
                    raise MessageFormatError(f"{self.peer} sent an unknown dtype code {h[5]} "
                                             f"or {h[6]} dimensions")
                dtype = DTYPES[h[5]]
                shape = tuple(h[7:7 + h[6]])
                payload = into(h[1], h[2], dtype, shape) if into is not None else None
                if h[_SHM_FIELD] >= 0:
                    payload = self._shared_payload(h, dtype, shape, payload)
                else:
                    if payload is None or payload.dtype != dtype or \
                            tuple(payload.shape) != shape or not payload.is_contiguous():
                        payload = torch.empty(shape, dtype=dtype)
                    if payload.numel() * payload.element_size() != h[4]:
                        raise MessageFormatError(f"{self.peer} sent {h[4]} bytes for a {dtype} "
                                                 f"tensor of shape {shape}")
                    if h[4]:
                        self._read_into(_as_bytes(payload), what, self.timeout_seconds)
            return Message(kind=h[1], var_id=h[2], version=h[3], a=h[13], b=h[14], c=h[15],
                           payload=payload)

    def _shared_payload(self, h: list[int], dtype: torch.dtype, shape: tuple[int, ...],
                        target: torch.Tensor | None) -> torch.Tensor:
        """The peer's payload in shared memory: a view, or copied into a matching ``target``."""
        view = None if self.lane is None or h[4] != math.prod(shape) * ITEMSIZE[dtype] else \
            self.lane.read(h[_SHM_FIELD], h[4], dtype, shape)
        if view is None:
            raise MessageFormatError(
                f"{self.peer} sent a payload of {h[4]} bytes at offset {h[_SHM_FIELD]} of a "
                "shared-memory region " + ("this end has not attached" if self.lane is None
                                           else f"of {self.lane.in_bytes} bytes"))
        if target is not None and target.dtype == dtype and tuple(target.shape) == shape \
                and target.is_contiguous():
            target.copy_(view)
            return target
        return view

    def close(self) -> None:
        """Close the connection (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def accept_connections(sock: socket.socket, timeout_seconds: float,
                       handle: Callable[[Connection], None], name: str,
                       going: Callable[[], bool], threads: list[threading.Thread] | None = None
                       ) -> None:
    """Accept connections on ``sock`` while ``going()``, each served by ``handle`` on a thread
    of its own (added to ``threads``); returns when ``going()`` is False or ``sock`` closed."""
    sock.settimeout(0.2)
    while going():
        try:
            client, _ = sock.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        t = threading.Thread(target=handle, args=(Connection(client, "a worker", timeout_seconds),),
                             daemon=True, name=name)
        t.start()
        if threads is not None:
            threads.append(t)


def text_tensor(text: str) -> torch.Tensor:
    """UTF-8 text as a uint8 tensor (for JSON descriptions; never pickle)."""
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def tensor_text(tensor: torch.Tensor | None) -> str:
    """The text a :func:`text_tensor` carried."""
    return "" if tensor is None else tensor.numpy().tobytes().decode()

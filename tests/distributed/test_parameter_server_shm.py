"""The parameter server's shared-memory lane: taken on one host, equal to TCP payloads, off on
request or when the segment cannot be made, and a peer killed in the middle of a transfer still
gives the named errors (real processes; one in-process server for the handshake's refusals)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.comm import shm_segment
from replicator.ps import protocol as P
from tests.distributed.test_parameter_server import batches
from tests.helpers import launch, make_mlp

STEPS = 15


def _lane_segments() -> set[str]:
    """The parameter-server lane's segments (``replicator-shm-ps<k>-w<worker>-...``) alone: a
    test on the other pytest-xdist worker may hold a checkpoint's staging segment meanwhile."""
    lane = shm_segment.NAME_PREFIX + "ps"
    return {n for n in os.listdir(shm_segment.shm_dir()) if n.startswith(lane)}


def train_sync(shared_memory: bool | None = None) -> dict:
    """2 workers + 2 servers, staleness=0, a weight split over both servers, SGD+momentum."""
    part = rp.ps.partitioners.MinSizePartitioner(min_shard_bytes=512, max_shards=2)
    strategy = rp.ParameterServerStrategy(num_ps=2, staleness=0, variable_partitioner=part,
                                          shared_memory=shared_memory)
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    it = batches(strategy)
    for _ in range(STEPS):
        strategy.run(step, args=(next(it),))
    return {"shared": strategy.shared_memory, "reason": strategy._client.shared_off,
            "versions": [v["version"] for v in strategy.shard_versions()],
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def tcp_reference() -> list:
    """The job with ``shared_memory=False``: every payload on TCP (the tests' reference)."""
    return launch(train_sync, num_replicas=4, num_ps=2, kwargs={"shared_memory": False},
                  timeout_seconds=60)


@pytest.mark.timeout(240)
def test_same_host_payloads_go_through_shared_memory_and_equal_tcp(monkeypatch, tcp_reference):
    before = _lane_segments()
    shm = launch(train_sync, num_replicas=4, num_ps=2, timeout_seconds=60)
    tcp = tcp_reference
    assert [r["shared"] for r in shm[:2]] == [[True, True]] * 2
    assert [r["shared"] for r in tcp[:2]] == [[False, False]] * 2
    assert all(v == STEPS for v in shm[0]["versions"]), shm[0]["versions"]
    for name, value in tcp[0]["params"].items():  # bit for bit: the same arithmetic
        assert torch.equal(shm[0]["params"][name], value), name
        assert torch.equal(shm[1]["params"][name], value), name
    assert _lane_segments() <= before  # every segment was unlinked once both ends mapped it
    # off for the whole job through the environment (inherited by the launched processes)
    monkeypatch.setenv(P.SHARED_MEMORY_ENV, "0")
    off = launch(train_sync, num_replicas=4, num_ps=2, timeout_seconds=60)
    assert off[0]["shared"] == [False, False] and off[0]["reason"] == ""
    for name, value in tcp[0]["params"].items():
        assert torch.equal(off[0]["params"][name], value), name


@pytest.mark.timeout(240)
def test_a_segment_that_cannot_be_made_falls_back_to_tcp(monkeypatch, tmp_path, tcp_reference):
    monkeypatch.setenv("REPLICATOR_SHM_DIR", str(tmp_path / "missing"))
    out = launch(train_sync, num_replicas=4, num_ps=2, timeout_seconds=60)
    assert out[0]["shared"] == [False, False]
    assert "could not create" in out[0]["reason"] and "FileNotFoundError" in out[0]["reason"]
    for name, value in tcp_reference[0]["params"].items():
        assert torch.equal(out[0]["params"][name], value), name


@pytest.mark.timeout(60)
def test_server_refuses_the_lane_when_switched_off_and_the_worker_keeps_tcp():
    from replicator.cluster.ports import listen
    from replicator.ps.client import ServerClient
    from replicator.ps.server import ParameterServer

    for on in (True, False):
        sock = listen("127.0.0.1", 0)
        server = ParameterServer(0, 1, None, sock, 5.0, shared_memory=on)
        thread = threading.Thread(target=server.serve, daemon=True)
        thread.start()
        client = ServerClient([sock.getsockname()[:2]], [1], 0, 0, 5.0, lambda k: ["w"])
        client.register({0: [(0, torch.ones(4, 4))]})
        p = torch.nn.Parameter(torch.ones(4, 4))
        client.send_optimizer(P.describe_optimizer(torch.optim.SGD([p], lr=0.5), {0: 0}))
        client.share_memory({0: (64, 64)}, worker=0)
        assert client.shared == [on]
        assert ("switched off on parameter server 0" in client.shared_off) is not on
        got: dict[int, torch.Tensor] = {}
        for _ in range(3):  # the same lane region is reused push after push
            client.push({0: [(0, 0, torch.full((4, 4), 2.0))]},
                        lambda s, v, t, got=got: got.update({s: t.clone()}))
        assert torch.equal(got[0], torch.full((4, 4), -2.0))  # 1 - 3 * 0.5 * 2
        client.close()
        thread.join(5)
        assert not thread.is_alive()


BIG = (1024, 2048)  # 8 MB of float32: a transfer takes long enough to be cut in the middle


def lose_a_peer_mid_transfer(victim: str) -> dict:
    """1 server, 2 workers; pushes and pulls of 8 MB in a loop (the loop does nothing else, so
    the kill lands inside a transfer) while a timer SIGKILLs the server (from worker 0, and
    the workers raise) or worker 1 (itself)."""
    strategy = rp.ParameterServerStrategy(num_ps=1, timeout_seconds=20)
    with strategy.scope():
        model = torch.nn.Linear(BIG[1], BIG[0], bias=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    me = strategy.replica_id
    shared = strategy.shared_memory
    target = strategy.server_pids[0] if victim == "server" else os.getpid()
    if (victim == "server" and me == 0) or (victim == "worker" and me == 1):
        threading.Timer(0.5, os.kill, args=(target, signal.SIGKILL)).start()
    assert shared == [True], shared
    steps, start = 0, time.monotonic()
    while steps < 200 and time.monotonic() - start < 60:
        model.weight.grad = torch.ones(BIG)
        optimizer.step()
        steps += 1
    return {"shared": shared, "steps": steps,
            "version": strategy.shard_versions()[0]["version"]}


@pytest.mark.timeout(180)
def test_a_server_killed_during_a_shared_memory_transfer_is_the_named_error():
    with pytest.raises(rp.WorkerFailedError) as info:
        launch(lose_a_peer_mid_transfer, num_replicas=3, num_ps=1, args=("server",),
               timeout_seconds=20)
    text = "\n".join([str(info.value), *info.value.others])
    assert "ParameterServerLostError" in text and "parameter server 0 (rank 2) is lost" in text
    assert "weight" in text and "AssertionError" not in text


@pytest.mark.timeout(180)
def test_a_worker_killed_during_a_shared_memory_transfer_leaves_the_others_going():
    out = launch(lose_a_peer_mid_transfer, num_replicas=3, num_ps=1, args=("worker",),
                 timeout_seconds=20)
    chief = out[0]
    assert chief["shared"] == [True], chief
    assert chief["steps"] == 200
    assert chief["version"] >= 200  # its own updates, and the lost worker's applied ones


@pytest.mark.timeout(30)
def test_messages_through_a_lane_carry_only_headers_and_check_offsets():
    import socket

    from replicator.comm.shm_segment import SharedSegment
    from replicator.ps.messages import Connection, MessageFormatError, SharedLane

    x, y = socket.socketpair()
    a, b = Connection(x, "peer a", 5.0), Connection(y, "peer b", 5.0)
    size, first, second = SharedLane.layout(4096, 4096)
    mine = SharedSegment.create_named(size, "test")
    theirs = SharedSegment.open_named(mine.name, size)
    assert mine.name not in os.listdir(shm_segment.shm_dir())  # unlinked once the peer mapped it
    a.lane = SharedLane(mine, out=first, inbox=second)
    b.lane = SharedLane(theirs, out=second, inbox=first)
    sent = [torch.randn(3, 4), torch.arange(5, dtype=torch.int64), torch.zeros(0, 2),
            torch.tensor(True)]
    a.send_many([(P.VALUE, i, 0, t, 0, 0, 0) for i, t in enumerate(sent)]
                + [(P.VALUES_END, -1, 0, None, 0, 0, 0)], shared=True)
    target = torch.empty(3, 4)
    for i, t in enumerate(sent):
        msg = b.receive(into=lambda *_: target)
        assert msg.payload is not None and torch.equal(msg.payload, t)
        if i == 0:
            assert msg.payload is target  # copied once to where it belongs
        elif t.numel():  # a view of the segment
            start = theirs.base.data_ptr()
            assert start <= msg.payload.data_ptr() <= start + size
    assert b.receive().kind == P.VALUES_END
    # too big for the lane: the same batch goes on the socket
    b.send_many([(P.VALUE, 0, 0, torch.ones(2048), 0, 0, 0)], shared=True)
    assert torch.equal(a.receive().payload, torch.ones(2048))
    b.lane = None  # a header pointing into shared memory this end never attached
    a.send_many([(P.VALUE, 0, 0, torch.ones(4), 0, 0, 0)], shared=True)
    with pytest.raises(MessageFormatError, match="has not attached"):
        b.receive()
    with pytest.raises(ValueError, match="not a replicator shared-memory segment"):
        SharedSegment.open_named("../etc/passwd", 4096)


def test_a_large_shard_answers_in_parts_that_land_in_the_parameter():
    """Values of a 3 MB shard come back through the lane in 1 MB parts (the worker copies one
    while the server writes the next), straight into the tensor ``into`` names; over TCP the
    answer stays whole. Both give the same values."""
    from replicator.cluster.ports import listen
    from replicator.ps.client import ServerClient
    from replicator.ps.messages import HEADER_BYTES
    from replicator.ps.server import ParameterServer

    shape = (768, 1024)  # 3 MB: 3 parts of 256 rows
    start = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    received = {}
    for on in (True, False):
        sock = listen("127.0.0.1", 0)
        server = ParameterServer(0, 1, None, sock, 5.0, shared_memory=on)
        thread = threading.Thread(target=server.serve, daemon=True)
        thread.start()
        landing = torch.zeros(shape)

        def into(kind, sid, dtype, want, landing=landing):
            return landing if kind == P.VALUE and sid == 0 and want == shape else None

        client = ServerClient([sock.getsockname()[:2]], [1], 0, 0, 5.0, lambda k: ["w"],
                              into=into)
        client.register({0: [(0, start.clone())]})
        p = torch.nn.Parameter(torch.zeros(shape))
        client.send_optimizer(P.describe_optimizer(torch.optim.SGD([p], lr=0.5), {0: 0}))
        client.share_memory({0: (8 << 20, 8 << 20)}, worker=0)
        assert client.shared == [on]
        got: dict[int, torch.Tensor] = {}
        before = client.traffic()["received"]
        for _ in range(2):  # the lane is reused answer after answer
            client.push({0: [(0, 0, grad)]}, lambda s, v, t, got=got: got.update({s: t}))
        headers = (client.traffic()["received"] - before - 2 * start.nbytes) // HEADER_BYTES
        assert got[0] is landing  # every part landed in the named tensor, whole over TCP too
        received[on] = (landing.clone(), headers)
        client.close()
        thread.join(5)
    expected = start - 2 * 0.5 * grad
    assert torch.allclose(received[True][0], expected, atol=1e-6) and torch.equal(*[
        received[on][0] for on in (True, False)])
    assert received[True][1] == 2 * (3 + 1)  # per answer: 3 parts and the end marker
    assert received[False][1] == 2 * (1 + 1)

"""The parameter server's parts in one process: partitioners and placement, the claim ledger,
typed tensor messages over a socket pair, the optimizer description, launcher checks."""

from __future__ import annotations

import json
import socket

import pytest
import torch

import replicator as rp
from replicator.errors import ClusterConfigError
from replicator.launch.launcher import check_num_ps
from replicator.ps import protocol as P
from replicator.ps.claims import EPOCH_DONE, WAIT, ClaimLedger
from replicator.ps.messages import Connection, MessageFormatError, PeerLostError
from replicator.ps.partitioners import place


def test_min_size_partitioner_splits_by_bytes_within_caps():
    part = rp.ps.partitioners.MinSizePartitioner(min_shard_bytes=1024, max_shards=4)
    assert part.num_shards((64, 16), torch.float32) == 4      # 4 KiB: 4 shards of 1 KiB
    assert part.num_shards((8, 16), torch.float32) == 1       # 512 B: too small to split
    assert part.num_shards((2, 1024), torch.float32) == 2     # never more shards than rows
    assert part((64, 16), torch.float32) == [4, 1]            # TensorFlow's form
    assert rp.ps.partitioners.FixedShardsPartitioner(3).num_shards((10, 2), torch.float32) == 3
    assert rp.ps.partitioners.FixedShardsPartitioner(3).num_shards((2,), torch.float32) == 2
    with pytest.raises(ValueError, match="max_shards"):
        rp.ps.partitioners.MinSizePartitioner(max_shards=0)


def test_placement_is_even_by_size_and_covers_every_row():
    variables = [("big", torch.zeros(100, 10)), ("mid", torch.zeros(50, 10)),
                 ("small", torch.zeros(40, 10)), ("scalar", torch.zeros(()))]
    shards = place(variables, 2)
    by_server = {s.name: s.server for s in shards}
    assert by_server["big"] != by_server["mid"]  # the two largest go to different servers
    assert by_server["small"] == by_server["mid"]  # then the lighter server takes the next
    split = place(variables, 3, rp.ps.partitioners.FixedShardsPartitioner(3))
    rows = sorted((s.start, s.end) for s in split if s.name == "big")
    assert rows == [(0, 33), (33, 66), (66, 100)]
    assert {s.server for s in split if s.name == "big"} == {0, 1, 2}
    assert [s.shard_id for s in split] == list(range(len(split)))


def test_claim_ledger_gives_each_batch_once_and_takes_back_a_lost_workers():
    ledger = ClaimLedger()
    e0 = (0, 0)  # stream 0, epoch 0
    assert [ledger.claim(0, e0, 3), ledger.claim(1, e0, 3)] == [0, 1]
    ledger.consume(0, e0, 0)
    assert ledger.claim(0, e0, 3) == 2
    ledger.consume(0, e0, 2)
    assert ledger.claim(0, e0, 3) == WAIT  # batch 1 is still in flight with worker 1
    assert ledger.claim(0, (1, 0), 5) == 0  # another input stream is counted apart
    assert ledger.give_back(1) == 1       # worker 1 is lost before its update landed
    assert ledger.claim(0, e0, 3) == 1
    ledger.consume(0, e0, 1)
    assert ledger.claim(0, e0, 3) == EPOCH_DONE
    summary = ledger.summary()[0]
    assert summary == {"batches": 3, "consumed": 3, "repeated": 0, "by_worker": {0: 3},
                       "in_flight": 0}
    again = ClaimLedger()
    again.load(json.loads(json.dumps(ledger.state())))
    assert again.summary() == ledger.summary()
    assert ledger.summary(1)[0]["in_flight"] == 1
    with pytest.raises(ValueError, match="same datasets"):
        ledger.claim(0, e0, 4)


def _pair(timeout: float = 5.0) -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a, "peer a", timeout), Connection(b, "peer b", timeout)


@pytest.mark.timeout(30)
def test_typed_tensor_messages_round_trip_every_dtype_and_shape():
    a, b = _pair()
    sent = [torch.randn(3, 4), torch.arange(6, dtype=torch.int64).reshape(2, 3),
            torch.randn(5).to(torch.bfloat16), torch.tensor(True), torch.zeros(0, 3)]
    a.send_many([(P.VALUE, i, 10 + i, t, 1, 2, 3) for i, t in enumerate(sent)])
    a.send(P.VALUES_END)
    for i, t in enumerate(sent):
        msg = b.receive()
        assert (msg.kind, msg.var_id, msg.version, msg.a, msg.b, msg.c) == \
            (P.VALUE, i, 10 + i, 1, 2, 3)
        assert msg.payload is not None and msg.payload.dtype == t.dtype
        assert torch.equal(msg.payload, t)
    end = b.receive()
    assert end.kind == P.VALUES_END and end.payload is None
    a.close()
    with pytest.raises(PeerLostError, match="closed the connection"):
        b.receive()


@pytest.mark.timeout(30)
def test_messages_refuse_foreign_bytes_and_time_out():
    a, b = _pair(timeout=0.3)
    a.sock.sendall(b"GET / HTTP/1.1\r\n" * 16)
    with pytest.raises(MessageFormatError, match="without the replicator header"):
        b.receive()
    c, d = _pair(timeout=0.3)
    with pytest.raises(PeerLostError, match="sent nothing"):
        d.receive()


def test_optimizer_description_rebuilds_the_same_optimizer():
    p = torch.nn.Parameter(torch.zeros(3))
    adam = torch.optim.Adam([p], lr=0.01, betas=(0.8, 0.9), weight_decay=0.1)
    spec = json.loads(P.describe_optimizer(adam, {7: 0}))
    assert spec["class"] == "Adam" and spec["shard_groups"] == {"7": 0}
    built = P.build_optimizer(spec, torch.nn.Parameter(torch.zeros(3)), 0)
    assert isinstance(built, torch.optim.Adam)
    assert built.param_groups[0]["betas"] == (0.8, 0.9)
    assert built.param_groups[0]["weight_decay"] == 0.1

    class Custom(torch.optim.SGD):
        pass

    with pytest.raises(P.ParameterServerError, match="not a torch.optim optimizer"):
        P.describe_optimizer(Custom([p], lr=0.1), {})


def test_optimizer_key_changes_whenever_the_description_would():
    p = torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    key = P.optimizer_key(sgd, {0: 0})
    assert key is not None and key == P.optimizer_key(sgd, {0: 0})
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    sgd.step()
    sched.step()  # a schedule's new learning rate is a new key (and is sent)
    assert P.optimizer_key(sgd, {0: 0}) != key
    assert P.optimizer_key(sgd, {0: 1}) != P.optimizer_key(sgd, {0: 0})
    sgd.param_groups[0]["nesterov"] = 0
    before = P.optimizer_key(sgd, {0: 0})
    sgd.param_groups[0]["nesterov"] = False  # 0 == False, but JSON says 0 and false
    assert P.optimizer_key(sgd, {0: 0}) != before
    # a tensor learning rate can change in place: no key, the description is made each step
    adam = torch.optim.Adam([p], lr=torch.tensor(0.01))
    assert P.optimizer_key(adam, {0: 0}) is None


def test_num_ps_must_leave_a_worker():
    assert check_num_ps(2, 3) == 2
    with pytest.raises(ClusterConfigError, match="leaves no worker"):
        check_num_ps(2, 2)
    with pytest.raises(ClusterConfigError):
        check_num_ps(-1, 2)


def _server(staleness: int | None = None):
    import threading

    from replicator.cluster.ports import listen
    from replicator.ps.client import ServerClient
    from replicator.ps.server import ParameterServer

    sock = listen("127.0.0.1", 0)
    server = ParameterServer(0, 1, staleness, sock, 5.0)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    client = ServerClient([sock.getsockname()[:2]], [1], 0, 0, 5.0, lambda k: ["w"])
    return server, thread, client


@pytest.mark.timeout(60)
def test_server_applies_the_described_optimizer_and_counts_versions():
    server, thread, client = _server()
    client.register({0: [(0, torch.ones(2, 2))]})
    p = torch.nn.Parameter(torch.ones(2, 2))
    client.send_optimizer(P.describe_optimizer(torch.optim.SGD([p], lr=0.5), {0: 0}))
    got: dict[int, tuple[int, torch.Tensor]] = {}
    client.push({0: [(0, 0, torch.full((2, 2), 2.0))]}, lambda s, v, t: got.update({s: (v, t)}))
    assert got[0][0] == 1 and torch.equal(got[0][1], torch.zeros(2, 2))  # 1 - 0.5 * 2
    stats = client.stats()[0]
    assert stats["versions"] == {"0": 1}
    assert stats["staleness"][:3] == [1, 0, 0]  # one update, staleness 0
    client.close()
    thread.join(5)
    assert not thread.is_alive()  # every worker came and went: the server is done


@pytest.mark.timeout(60)
def test_server_refuses_a_gradient_before_the_optimizer_description():
    server, thread, client = _server()
    client.register({0: [(0, torch.ones(2))]})
    with pytest.raises(P.ParameterServerError, match="before the optimizer"):
        client.push({0: [(0, 0, torch.ones(2))]}, lambda *a: None)
    client.close()
    thread.join(5)
    assert not thread.is_alive()


@pytest.mark.timeout(60)
def test_server_state_survives_a_checkpoint_and_restore(tmp_path):
    import threading

    from replicator.cluster.ports import listen
    from replicator.ps.client import ServerClient
    from replicator.ps.server import ParameterServer

    server, thread, client = _server()
    server.checkpoint_dir = str(tmp_path)
    client.register({0: [(0, torch.ones(3))]})
    p = torch.nn.Parameter(torch.ones(3))
    client.send_optimizer(P.describe_optimizer(torch.optim.SGD([p], lr=0.1, momentum=0.9),
                                               {0: 0}))
    assert client.claim(0, 0, 4) == 0
    client.push({0: [(0, 0, torch.ones(3))]}, lambda *a: None, claim=(0, 0, 0))
    assert client.claim(0, 0, 4) == 1  # claimed, never pushed: handed out again on restore
    client.save(7, json.dumps({"directory": str(tmp_path), "worker_data": {"step": 7}}))
    client.close()
    thread.join(5)

    sock = listen("127.0.0.1", 0)
    again = ParameterServer(0, 1, None, sock, 5.0, checkpoint_dir=str(tmp_path))
    assert again.restored_step == 7 and again.clock == 1
    assert again.shards[0].version == 1
    assert torch.allclose(again.shards[0].param.detach(), torch.full((3,), 0.9))
    momentum = again.shards[0].optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.allclose(momentum, torch.ones(3))  # the optimizer's state came back
    t = threading.Thread(target=again.serve, daemon=True)
    t.start()
    client = ServerClient([sock.getsockname()[:2]], [1], 0, 0, 5.0, lambda k: ["w"])
    assert client.restored[0] == {"step": 7, "data": {"step": 7}}
    assert [client.claim(0, 0, 4), client.claim(0, 0, 4), client.claim(0, 0, 4)] == [1, 2, 3]
    client.close()
    t.join(5)

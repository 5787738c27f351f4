"""A worker's compact lookups of a sparse table and a server's shared optimizer steps, in one
process: both must give exactly what one device computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import replicator as rp
from replicator.ps.partitioners import place
from replicator.ps.server_updates import SharedSteps
from replicator.ps.sparse_tables import SparseTable, distinct_ids

ROWS, DIM = 50, 4


def _lookup(module: nn.Module, server_weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """What the strategy's hooks do around ``module(*args, **kwargs)``, with the rows taken
    from ``server_weight`` (the servers' values) instead of over the network."""
    shards = place([("w", module.weight.detach())], 2, rp.ps.FixedShardsPartitioner(2))
    table = SparseTable(module.weight, shards, "t", module)
    ids = args[0] if args else kwargs["input"]
    for items in table.rows_to_pull(ids).values():
        for sid, local in items:
            start = table.by_id[sid].start
            table.store_rows(sid, server_weight[local + start])
    table.begin(args, kwargs)
    return table.finish()


def _pair(cls: type, **options) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    reference = cls(ROWS, DIM, sparse=True, **options)
    worker = cls(ROWS, DIM, sparse=True, **options)
    with torch.no_grad():
        worker.weight.zero_()  # the worker's own copy is never read
    return reference, worker, reference.weight.detach().clone()


CASES = [
    (nn.Embedding, {}, lambda ids: ((ids,), {})),
    (nn.Embedding, {"padding_idx": 3}, lambda ids: ((), {"input": ids})),
    (nn.EmbeddingBag, {"mode": "mean"}, lambda ids: ((ids,), {})),
    (nn.EmbeddingBag, {"mode": "mean", "padding_idx": 3}, lambda ids: ((ids,), {})),
    (nn.EmbeddingBag, {"mode": "sum"},
     lambda ids: ((ids.reshape(-1), torch.tensor([0, 5, 9])),
                  {"per_sample_weights": torch.linspace(0.1, 1.0, ids.numel())})),
    (nn.EmbeddingBag, {"mode": "sum", "include_last_offset": True},
     lambda ids: ((ids.reshape(-1), torch.tensor([0, 5, 9, ids.numel()])), {})),
]


@pytest.mark.parametrize("cls,options,call", CASES)
def test_compact_lookup_equals_the_module_and_its_sparse_gradient(cls, options, call):
    reference, worker, server = _pair(cls, **options)
    ids = torch.tensor([[3, 7, 7, 49, 0], [25, 3, 11, 7, 24]])  # repeats, both shards, padding
    args, kwargs = call(ids)
    want = reference(*args, **kwargs)
    got = _lookup(worker, server, *args, **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    weights = torch.randn_like(want)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    assert worker.weight.grad.is_sparse
    torch.testing.assert_close(worker.weight.grad.to_dense(), reference.weight.grad.to_dense(),
                               rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(worker.weight.detach()) == 0  # never written


def test_two_lookups_of_one_table_add_their_gradients():
    reference, worker, server = _pair(nn.Embedding)
    a, b = torch.tensor([1, 2, 30]), torch.tensor([2, 40])
    (reference(a).sum() + 2 * reference(b).sum()).backward()
    (_lookup(worker, server, a).sum() + 2 * _lookup(worker, server, b).sum()).backward()
    torch.testing.assert_close(worker.weight.grad.to_dense(), reference.weight.grad.to_dense())


@pytest.mark.parametrize("ids", [
    torch.randint(0, 1_000_000, (5120,)), torch.randint(0, 50, (5120,)),
    torch.randint(0, 100_000, (1536,)), torch.tensor([7]), torch.tensor([], dtype=torch.long),
    torch.tensor([3, -1, 3]), torch.tensor([2**61, 5, 2**61]), torch.arange(9000).flip(0)])
def test_distinct_ids_equal_torch_unique(ids):
    rows, inverse = distinct_ids(ids)
    want_rows, want_inverse = torch.unique(ids, return_inverse=True)
    assert torch.equal(rows, want_rows) and torch.equal(inverse, want_inverse)
    assert rows.dtype == inverse.dtype == torch.int64


def test_ids_outside_the_table_raise_like_nn_embedding():
    _, worker, server = _pair(nn.Embedding)
    with pytest.raises(IndexError, match="index 50 is out of range.*50 rows"):
        _lookup(worker, server, torch.tensor([1, 50]))
    with pytest.raises(IndexError, match="index -1 is out of range"):
        _lookup(worker, server, torch.tensor([-1, 2]))


def test_max_norm_on_a_sparse_table_is_refused():
    """One device renormalises the looked-up rows of the table itself, in place; the servers'
    rows would never see it, so the strategy refuses it instead of differing silently."""
    from replicator.ps.sparse_tables import check_no_max_norm

    with pytest.raises(ValueError, match="max_norm=1.0.*HINT"):
        check_no_max_norm(nn.Embedding(ROWS, DIM, sparse=True, max_norm=1.0), "t")
    _, worker, server = _pair(nn.Embedding)
    worker.max_norm = 2.0  # set after the table was placed: refused at the lookup
    with pytest.raises(ValueError, match="max_norm=2.0"):
        _lookup(worker, server, torch.tensor([1, 2]))


def test_every_shard_gets_its_part_of_a_gradient_also_an_empty_one():
    """One device steps the whole table whenever it has a gradient (momentum moves rows looked
    up before, Adam counts the step), so every shard is pushed, with no rows if none of its
    rows was looked up."""
    _, worker, server = _pair(nn.Embedding)
    _lookup(worker, server, torch.tensor([1, 2, 3])).sum().backward()  # shard 0's rows only
    shards = place([("w", worker.weight.detach())], 2, rp.ps.FixedShardsPartitioner(2))
    table = SparseTable(worker.weight, shards, "t", worker)
    parts = [p for items in table.gradient_rows(worker.weight.grad, {}).values() for p in items]
    assert sorted(len(rows) for _, _, _, rows in parts) == [0, 3]
    for _, _, values, rows in parts:
        assert values.shape == (len(rows), DIM)


def _shards(n: int) -> list[nn.Parameter]:
    torch.manual_seed(1)
    return [nn.Parameter(torch.randn(3, 2)) for _ in range(n)]


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True),
    lambda p: torch.optim.Adam([p], lr=0.01, weight_decay=0.1),
    lambda p: torch.optim.AdamW([p], lr=0.01),
    lambda p: torch.optim.Adagrad([p], lr=0.1),
    lambda p: torch.optim.RMSprop([p], lr=0.01, momentum=0.5),
])
def test_shared_steps_equal_each_shard_stepped_alone(make):
    alone, shared = _shards(4), _shards(4)
    opts_alone = [make(p) for p in alone]
    opts_shared = [make(p) for p in shared]
    steps = SharedSteps()
    for step in range(5):
        if step == 3:  # a schedule changes the learning rate of every shard
            for o in opts_alone + opts_shared:
                o.param_groups[0]["lr"] *= 0.5
        with_grad = [0, 1, 2, 3] if step % 2 == 0 else [0, 2]  # a shard may get no gradient
        for i in with_grad:
            g = torch.full((3, 2), 0.1 * (step + 1) * (i + 1))
            alone[i].grad, shared[i].grad = g.clone(), g.clone()
        for i in with_grad:
            opts_alone[i].step()
        steps.step([opts_shared[i] for i in with_grad])
        for p in alone + shared:
            p.grad = None
    for a, s, oa, os_ in zip(alone, shared, opts_alone, opts_shared):
        torch.testing.assert_close(s, a, rtol=0, atol=0)
        sa, ss = oa.state_dict()["state"], os_.state_dict()["state"]  # per shard, as saved
        assert sa.keys() == ss.keys()
        for k in sa:
            for name, value in sa[k].items():
                torch.testing.assert_close(ss[k][name], value, rtol=0, atol=0)


def test_shared_steps_leave_apart_what_differs():
    params = _shards(3)
    opts = [torch.optim.SGD([params[0]], lr=0.1), torch.optim.SGD([params[1]], lr=0.2),
            torch.optim.Adam([params[2]], lr=0.1)]
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    SharedSteps().step(opts)
    torch.testing.assert_close(params[0], before[0] - 0.1)
    torch.testing.assert_close(params[1], before[1] - 0.2)
    assert not torch.equal(params[2], before[2])


def test_a_server_refuses_an_update_with_a_bad_part_and_changes_nothing():
    import socket

    from replicator.ps import protocol as P
    from replicator.ps.server import ParameterServer
    from replicator.ps.server_updates import ShardState

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        server = ParameterServer(0, num_workers=1, staleness=None, sock=sock,
                                 timeout_seconds=5)
        params = _shards(2)
        for sid, p in enumerate(params):
            server.shards[sid] = ShardState(p, optimizer=torch.optim.SGD([p], lr=0.1))
        before = [p.detach().clone() for p in params]
        good = (0, torch.ones(3, 2), None)
        with pytest.raises(P.ParameterServerError, match="holds no shard 7"):
            server._apply({0: good, 7: (0, torch.ones(3, 2), None)})
        with pytest.raises(P.ParameterServerError, match="sparse gradient rows"):
            server._apply({0: good, 1: (0, torch.ones(2, 2), torch.tensor([2, 1]))})
        for p, b in zip(params, before):
            torch.testing.assert_close(p, b, rtol=0, atol=0)
            assert p.grad is None
        assert sum(server.histogram) == 0  # a refused update is not counted either
        server._apply({0: good, 1: good})  # both shards, one shared step
        torch.testing.assert_close(params[0], before[0] - 0.1)
        torch.testing.assert_close(params[1], before[1] - 0.1)
        assert [server.shards[s].version for s in (0, 1)] == [1, 1]
        assert sum(server.histogram) == 2


def test_a_tables_weight_used_outside_its_modules_is_refused_at_the_push():
    """A tied output layer reads the worker's copy of the table, which a parameter server's
    table never updates: the dense gradient that use leaves is refused, naming the table."""
    _, worker, server = _pair(nn.Embedding)
    out = _lookup(worker, server, torch.tensor([1, 2]))
    (out.sum() + (out @ worker.weight.t()).sum()).backward()  # a tied projection
    assert not worker.weight.grad.is_sparse
    shards = place([("w", worker.weight.detach())], 2, rp.ps.FixedShardsPartitioner(2))
    table = SparseTable(worker.weight, shards, "t", worker)
    with pytest.raises(ValueError, match="sparse table t has a dense gradient.*HINT"):
        table.gradient_rows(worker.weight.grad, {})


def _table_lookup(table: SparseTable, server: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One call through ``table`` (its module's lookup), rows taken from ``server``."""
    for items in table.rows_to_pull(ids).values():
        for sid, local in items:
            table.store_rows(sid, server[local + table.by_id[sid].start])
    table.begin((ids,), {})
    return table.finish()


def test_a_gradient_of_the_pulled_rows_is_pushed_without_them_and_any_other_with_them():
    """A lookup's gradient rows are the rows it pulled, which the servers kept: the push
    names them AS_PULLED (not sent again) for the shards that pull asked, and sends rows
    for an empty shard, for two lookups' summed gradient, and when another pull came since."""
    from replicator.ps.client import AS_PULLED

    _, worker, server = _pair(nn.Embedding)
    shards = place([("w", worker.weight.detach())], 2, rp.ps.FixedShardsPartitioner(2))
    table = SparseTable(worker.weight, shards, "t", worker)

    def parts() -> dict[int, object]:
        out = table.gradient_rows(worker.weight.grad, {})
        worker.weight.grad = None
        return {sid: rows for items in out.values() for sid, _, _, rows in items}

    _table_lookup(table, server, torch.tensor([1, 2, 3])).sum().backward()  # shard 0 only
    got = parts()
    assert got[0] is AS_PULLED and len(got[1]) == 0  # shard 1 was not pulled: empty rows
    _table_lookup(table, server, torch.tensor([1, 30])).sum().backward()
    got = parts()
    assert got[0] is AS_PULLED and got[1] is AS_PULLED
    (_table_lookup(table, server, torch.tensor([1, 2])).sum()
     + _table_lookup(table, server, torch.tensor([40])).sum()).backward()
    got = parts()
    assert got[0].tolist() == [1, 2] and got[1].tolist() == [15]  # summed: rows sent
    _table_lookup(table, server, torch.tensor([4, 30])).sum().backward()
    with torch.no_grad():
        _table_lookup(table, server, torch.tensor([5]))  # a later pull: the servers keep it
    got = parts()
    assert got[0].tolist() == [4] and got[1].tolist() == [5]


def test_a_server_refuses_rows_as_pulled_that_it_never_served():
    import socket

    from replicator.ps import protocol as P
    from replicator.ps.messages import Message
    from replicator.ps.server import ParameterServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        server = ParameterServer(0, num_workers=1, staleness=None, sock=sock,
                                 timeout_seconds=5)
        grad = Message(P.GRAD, 3, 0, 0, 0, 2, torch.ones(2, 4))
        with pytest.raises(P.ParameterServerError, match="shard 3 names the rows of the last"):
            server._gradient_rows({}, grad, {})
        with pytest.raises(P.ParameterServerError, match="announced 2 shard.*named 1"):
            server._rows_asked(Message(P.PULL_ROWS, 3, 0, 2, 0, 0, torch.arange(3)), {})


@pytest.mark.parametrize("options", [{}, {"maximize": True}, {"momentum": 0.9},
                                     {"momentum": 0.5, "dampening": 0.1}])
def test_a_server_steps_table_rows_as_torchs_sparse_sgd_does(options):
    """Plain SGD's rows are updated in place without stepping the optimizer (momentum keeps
    torch's sparse step); either way the shard ends as torch's sparse SGD leaves it."""
    import socket

    from replicator.ps.server import ParameterServer
    from replicator.ps.server_updates import ShardState, plain_sgd_alpha

    torch.manual_seed(0)
    table = torch.randn(50, 4)
    reference = nn.Parameter(table.clone())
    ref_opt = torch.optim.SGD([reference], lr=0.05, **options)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        server = ParameterServer(0, num_workers=1, staleness=None, sock=sock,
                                 timeout_seconds=5)
        shard = nn.Parameter(table.clone())
        opt = torch.optim.SGD([shard], lr=0.05, **options)
        server.shards[0] = ShardState(shard, optimizer=opt, sparse=True)
        assert (plain_sgd_alpha(opt) is not None) == (not options.get("momentum"))
        for step in range(4):
            rows = torch.randperm(50)[:7].sort().values
            values = torch.randn(7, 4)
            reference.grad = torch.sparse_coo_tensor(rows.reshape(1, -1), values, (50, 4))
            ref_opt.step()
            server._apply({0: (step, values, rows)})
            torch.testing.assert_close(shard, reference, rtol=0, atol=1e-7)
            assert shard.grad is None
        assert server.shards[0].version == 4


def test_plain_sgd_is_only_sgd_without_momentum_decay_or_hooks():
    from replicator.ps.server_updates import plain_sgd_alpha

    p = nn.Parameter(torch.zeros(3))
    assert plain_sgd_alpha(torch.optim.SGD([p], lr=0.1)) == -0.1
    assert plain_sgd_alpha(torch.optim.SGD([p], lr=0.1, maximize=True)) == 0.1
    assert plain_sgd_alpha(torch.optim.SGD([p], lr=0.1, momentum=0.9)) is None
    assert plain_sgd_alpha(torch.optim.SGD([p], lr=0.1, weight_decay=0.1)) is None
    assert plain_sgd_alpha(torch.optim.Adagrad([p], lr=0.1)) is None
    hooked = torch.optim.SGD([p], lr=0.1)
    hooked.register_step_post_hook(lambda *a: None)
    assert plain_sgd_alpha(hooked) is None

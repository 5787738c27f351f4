"""A worker's view of a sparse embedding table (``sparse=True``) split row-wise over the servers:
each lookup pulls only the distinct rows it needs into a compact tensor and computes from
them; backward gives torch's sparse gradient of those rows, which the push sends per shard.
:class:`TableLookups` finds a worker's tables and hooks the modules that look them up."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from replicator.ps.client import AS_PULLED, Push, Sink
from replicator.ps.partitioners import Shard

#: Per server: (shard id, shard-local rows) pairs.
RowsByServer = dict[int, list[tuple[int, torch.Tensor]]]


def distinct_ids(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(flat, return_inverse=True)`` of a 1-D CPU int64 tensor, by a packed numpy
    sort (ids packed with their positions; several times faster for thousands of ids)."""
    n, ids = flat.numel(), flat.numpy()
    shift = max(1, (n - 1).bit_length())
    if n < 2 or n > 1 << 30 or ids.min() < 0 or int(ids.max()) >= 1 << (62 - shift):
        return torch.unique(flat, return_inverse=True)
    packed = np.left_shift(ids, shift)
    packed |= np.arange(n, dtype=np.int64)
    packed.sort()
    ordered = packed >> shift
    first = np.empty(n, dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(n, dtype=np.int64)
    inverse[packed & ((1 << shift) - 1)] = np.cumsum(first) - 1
    return torch.from_numpy(ordered[first]), torch.from_numpy(inverse)


class _PulledRows(torch.autograd.Function):
    """The rows a lookup pulled, as a function of the table's weight: their gradient reaches
    the weight as a sparse gradient of those rows (indices remembered by ``table``)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, rows: torch.Tensor, values: torch.Tensor,
                table: SparseTable) -> torch.Tensor:
        ctx.rows, ctx.shape, ctx.table = rows, weight.shape, table
        return values.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        rows = ctx.rows
        if grad.is_sparse:  # the lookup's own gradient: one entry per id
            summed = torch.zeros((len(rows), *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            summed.index_add_(0, grad._indices()[0], grad._values())
        else:
            summed = grad.contiguous()
        indices = rows.reshape(1, -1).to(grad.device)  # rows are kept on the CPU
        made = ctx.table._coalesced
        made.append(indices)
        del made[:-64]  # backward passes without a push (gradients looked at, not stepped)
        return torch.sparse_coo_tensor(indices, summed, ctx.shape, is_coalesced=True,
                                       check_invariants=False), None, None, None


class _Lookup:
    """One call of the table's module: its arguments, the distinct rows and their values."""

    def __init__(self, args: tuple, kwargs: dict[str, Any], ids: torch.Tensor,
                 rows: torch.Tensor, inverse: torch.Tensor, values: torch.Tensor) -> None:
        self.args, self.kwargs = args, kwargs
        self.module: torch.nn.Module | None = None
        self.ids, self.rows, self.inverse, self.values = ids, rows, inverse, values


class SparseTable:
    """The shards of one table (a parameter of ``rows x dim``) and its module's lookups."""

    def __init__(self, param: torch.Tensor, shards: Sequence[Shard], name: str,
                 module: torch.nn.Embedding | torch.nn.EmbeddingBag | None = None) -> None:
        self.param, self.name, self.module = param, name, module
        self.shards = sorted(shards, key=lambda s: s.start)
        self.by_id = {s.shard_id: s for s in self.shards}
        self._bounds = torch.tensor([b for s in self.shards for b in (s.start, s.end)],
                                    dtype=torch.int64)
        #: Where each shard's rows of the current lookup sit in its compact values.
        self._slices: dict[int, tuple[int, int]] = {}
        self._lookup: _Lookup | None = None
        #: Indices of the sparse gradients this table's lookups made since the last push.
        self._coalesced: list[torch.Tensor] = []
        #: The distinct rows of the last pull, and the shards it asked rows of: a gradient
        #: of exactly those rows is pushed without them (the servers kept what was pulled).
        self._pulled_rows: torch.Tensor | None = None
        self._pulled_shards: set[int] = set()

    def _split(self, rows: torch.Tensor) -> list[tuple[Shard, int, int]]:
        """For sorted, distinct global ``rows``: each shard with the slice of them it holds
        (one search for every shard's bounds)."""
        at = torch.searchsorted(rows, self._bounds).tolist()
        return [(s, at[2 * k], at[2 * k + 1]) for k, s in enumerate(self.shards)
                if at[2 * k + 1] > at[2 * k]]

    def rows_to_pull(self, ids: torch.Tensor) -> RowsByServer:
        """The distinct rows ``ids`` looks up, grouped by server and shard (shard-local);
        an id outside the table raises ``IndexError`` as ``nn.Embedding`` does."""
        flat = ids.detach().reshape(-1).to("cpu", torch.int64)  # the row ids travel from here
        rows, inverse = distinct_ids(flat)
        n = len(self.param)
        first, last = rows[[0, -1]].tolist() if rows.numel() else (0, 0)
        if first < 0 or last >= n:
            bad = first if first < 0 else last
            raise IndexError(f"index {bad} is out of range for the sparse table {self.name} "
                             f"of {n} rows")
        values = torch.empty((len(rows), *self.param.shape[1:]), dtype=self.param.dtype,
                             device=self.param.device)
        self._lookup = _Lookup((), {}, ids, rows, inverse.reshape(ids.shape).to(ids.device), values)
        self._slices = {}
        out: RowsByServer = {}
        for s, lo, hi in self._split(rows):
            self._slices[s.shard_id] = (lo, hi)
            out.setdefault(s.server, []).append((s.shard_id, rows[lo:hi] - s.start))
        self._pulled_rows, self._pulled_shards = rows, set(self._slices)
        return out

    def store_rows(self, shard_id: int, values: torch.Tensor) -> None:
        """Take pulled values of ``shard_id``'s rows into the current lookup's compact rows."""
        assert self._lookup is not None, "store_rows before rows_to_pull"
        lo, hi = self._slices[shard_id]
        self._lookup.values[lo:hi].copy_(values.reshape(hi - lo, *self.param.shape[1:]))

    # -- the module's call, with the pulled rows ----------------------------------------------
    def begin(self, args: tuple, kwargs: dict[str, Any], module: torch.nn.Module | None = None
              ) -> tuple[tuple, dict[str, Any]]:
        """Keep the call's arguments (``rows_to_pull`` ran on its ids) and give the module an
        empty lookup to compute instead (its output is replaced by :meth:`finish`)."""
        assert self._lookup is not None
        module = self.module if module is None else module
        self._lookup.args, self._lookup.kwargs, self._lookup.module = args, kwargs, module
        ids = self._lookup.ids
        if isinstance(module, torch.nn.EmbeddingBag):
            offsets = torch.zeros(1 + int(module.include_last_offset), dtype=torch.int64,
                                  device=ids.device)
            return (ids.new_empty(0), offsets), {}
        return (ids.reshape(-1)[:0],), {}

    def cancel(self) -> None:
        """Forget a lookup whose rows are not used (the module computes on its own)."""
        self._lookup = None

    @property
    def pending(self) -> bool:
        """Whether a call's rows were pulled and its output is still to be computed."""
        return self._lookup is not None

    def finish(self) -> torch.Tensor:
        """The module's output for the kept call, computed from the pulled rows."""
        call, self._lookup = self._lookup, None
        assert call is not None and call.module is not None
        m = call.module
        if not isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            raise TypeError(f"{type(m).__name__} is not an embedding module")
        check_no_max_norm(m, self.name)  # set after the table was placed
        weight = _PulledRows.apply(self.param, call.rows, call.values, self)
        padding = None
        if m.padding_idx is not None:
            pad = m.padding_idx % len(self.param)
            at = int(torch.searchsorted(call.rows, pad))
            padding = at if at < len(call.rows) and int(call.rows[at]) == pad else None
        if isinstance(m, torch.nn.EmbeddingBag):
            args, kwargs = call.args, call.kwargs  # offsets, per_sample_weights
            offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
            psw = args[2] if len(args) > 2 else kwargs.get("per_sample_weights")
            return F.embedding_bag(call.inverse, weight, offsets, m.max_norm, m.norm_type,
                                   m.scale_grad_by_freq, m.mode, m.mode != "max", psw,
                                   m.include_last_offset, padding)
        # sparse: the gradient per id costs nothing to make; _PulledRows sums it per row
        return F.embedding(call.inverse, weight, padding, m.max_norm, m.norm_type,
                           m.scale_grad_by_freq, True)

    def gradient_rows(self, grad: torch.Tensor, pulled: dict[int, int]) -> dict[int, list[Push]]:
        """A sparse gradient of the table as pushes per server: ``(shard id, version pulled,
        values, shard-local rows)``, the rows :data:`~replicator.ps.client.AS_PULLED` where
        they are the last pull's; a dense gradient is refused (see the error)."""
        made, self._coalesced = self._coalesced, []
        last, self._pulled_rows = self._pulled_rows, None  # a push uses the last pull once
        as_pulled: set[int] = set()
        if grad.is_sparse and any(grad._indices() is i or (
                grad._indices().data_ptr() == i.data_ptr() and grad._nnz() == i.shape[1])
                for i in made):
            rows, values = grad._indices()[0], grad._values()  # one lookup's: sorted, distinct
            if last is not None and rows.data_ptr() == last.data_ptr() and \
                    rows.numel() == last.numel():
                as_pulled = self._pulled_shards  # the last lookup's rows, as it pulled them
        elif grad.is_sparse:
            g = grad.coalesce()
            rows, values = g.indices()[0], g.values()
        else:
            # only a use of the weight outside its embedding modules makes the gradient dense,
            # and such a use read the worker's copy, which no lookup keeps up to date
            raise ValueError(
                f"the sparse table {self.name} has a dense gradient: its weight was used "
                "outside its embedding modules (a tied output layer, a penalty on the weight), "
                "and those uses read the worker's copy of the table, which stays as built on "
                "a parameter server. HINT: use the table only through its nn.Embedding/"
                "EmbeddingBag modules, or build it with sparse=False (it then travels whole).")
        out: dict[int, list[Push]] = {}
        # every shard steps, as one device steps the whole table (momentum, Adam's step count),
        # also a shard none of whose rows were looked up (an empty gradient)
        found = {s.shard_id: (lo, hi) for s, lo, hi in self._split(rows)}
        for s in self.shards:
            lo, hi = found.get(s.shard_id, (0, 0))
            out.setdefault(s.server, []).append(
                (s.shard_id, pulled.get(s.shard_id, 0), values[lo:hi].contiguous(),
                 AS_PULLED if s.shard_id in as_pulled
                 else (rows[lo:hi] - s.start).contiguous()))
        return out


def check_no_max_norm(module: torch.nn.Module, name: str) -> None:
    """Refuse ``max_norm`` on a sparse table: one device renormalises the looked-up rows of the
    table itself in place, which the servers' rows would never see (a silent difference)."""
    max_norm = getattr(module, "max_norm", None)
    if max_norm is not None:
        raise ValueError(
            f"the sparse table {name} has max_norm={max_norm}: one device renormalises the "
            "looked-up rows of the table in place, which a parameter server's rows would not "
            "see. HINT: build the embedding without max_norm (renormalise its output instead) "
            "or with sparse=False (the table then travels whole).")


class TableLookups:
    """The sparse tables of one worker: ``pull_rows`` fetches rows into ``pulled`` (shard id ->
    version read); while ``closed()`` a module computes on its own."""

    def __init__(self, pull_rows: Callable[[RowsByServer, Sink], None],
                 pulled: dict[int, int], closed: Callable[[], bool]) -> None:
        self._pull_rows, self._pulled, self._closed = pull_rows, pulled, closed
        # keyed by the objects, never by id(): a new module or parameter may get the id of
        # one garbage-collected (a later model's table then went unhooked)
        self.tables: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its table
        self.sparse_ids: set[int] = set()         # shard ids of every table
        self._hooked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def find(self, module: torch.nn.Module, shards_of: WeakIdKeyDictionary) -> None:
        """Hook every sparse embedding module of ``module`` whose weight was placed
        (``shards_of``), a second module sharing a table's weight too."""
        for name, sub in module.named_modules():
            weight = getattr(sub, "weight", None)
            sparse = isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse
            if not sparse or weight is None or weight not in shards_of or sub in self._hooked:
                continue
            check_no_max_norm(sub, name or "embedding")
            self._hooked.add(sub)
            table = self.tables.get(weight)
            if table is None:
                table = SparseTable(weight, shards_of[weight], name or "embedding", sub)
                self.tables[weight] = table
                self.sparse_ids.update(s.shard_id for s in table.shards)
            sub.register_forward_pre_hook(
                lambda m, args, kwargs, t=table: self._pull(t, args, kwargs, m),
                with_kwargs=True)
            sub.register_forward_hook(
                lambda _m, _args, _out, t=table: t.finish() if t.pending else None)

    def _pull(self, table: SparseTable, args: tuple, kwargs: dict[str, Any],
              module: torch.nn.Module) -> tuple[tuple, dict[str, Any]] | None:
        """The forward pre-hook: pull the call's rows and hand the module an empty lookup."""
        ids = args[0] if args else kwargs.get("input")  # positional or input=
        if self._closed() or not isinstance(ids, torch.Tensor):
            table.cancel()
            return None
        wanted = table.rows_to_pull(ids)

        def sink(sid: int, version: int, values: torch.Tensor) -> None:
            table.store_rows(sid, values)
            self._pulled[sid] = version

        if wanted:
            self._pull_rows(wanted, sink)
        return table.begin(args, kwargs, module)

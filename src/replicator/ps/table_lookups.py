"""A worker's sparse tables: found among a module's placed parameters, and every module that
looks one up hooked, so that each call pulls the rows it needs from the servers and computes
from them (:mod:`replicator.ps.sparse_tables` has the lookup itself)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from replicator.ps.client import Sink
from replicator.ps.sparse_tables import (
    RowsByServer,
    SparseTable,
    check_no_max_norm,
    is_sparse_table,
    lookup_ids,
)


class TableLookups:
    """The sparse tables of one worker. ``pull_rows(rows, sink)`` fetches rows from the
    servers; ``pulled`` (shard id -> version) is the worker's record of what it read;
    ``closed()`` says the strategy has stopped (a module then computes on its own)."""

    def __init__(self, pull_rows: Callable[[RowsByServer, Sink], None],
                 pulled: dict[int, int], closed: Callable[[], bool]) -> None:
        self._pull_rows = pull_rows
        self._pulled = pulled
        self._closed = closed
        # keyed by the objects, never by id(): a new module or parameter may get the id of
        # one garbage-collected (a later model's table then went unhooked)
        self.tables: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its table
        self.sparse_ids: set[int] = set()         # shard ids of every table
        self._hooked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def find(self, module: torch.nn.Module, shards_of: WeakIdKeyDictionary) -> None:
        """Hook every sparse embedding module (``sparse=True``) of ``module`` whose weight was
        placed (``shards_of``: parameter -> its shards), also a second module sharing a
        table's weight; ``max_norm`` is refused (see :func:`check_no_max_norm`)."""
        for name, sub in module.named_modules():
            weight = getattr(sub, "weight", None)
            if not is_sparse_table(sub) or weight is None or weight not in shards_of \
                    or sub in self._hooked:
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
        ids = lookup_ids(args, kwargs)
        if self._closed() or ids is None:
            table.cancel()
            return None
        wanted = table.rows_to_pull(ids)

        def sink(sid: int, version: int, values: torch.Tensor) -> None:
            table.store_rows(sid, values)
            self._pulled[sid] = version

        if wanted:
            self._pull_rows(wanted, sink)
        return table.begin(args, kwargs, module)

"""A worker's view of a sparse embedding table split row-wise over the servers.

An ``nn.Embedding``/``nn.EmbeddingBag`` built with ``sparse=True`` in a parameter-server scope
is a *sparse table*: before each forward the worker pulls only the rows the batch looks up,
deduplicated (``torch.unique``), from the servers holding them, into its local copy of the
table (which serves as a cache: rows not looked up may be stale, and nothing reads them); the
gradient torch makes (a sparse tensor, duplicates summed by ``coalesce``) is pushed as rows and
values, each shard's part to its server. Shards hold contiguous row ranges (the partitioner's
split along dimension 0), so a row's shard is found by a binary search over the boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replicator.ps.partitioners import Shard

#: Per server: (shard id, shard-local rows) pairs.
RowsByServer = dict[int, list[tuple[int, torch.Tensor]]]


class SparseTable:
    """The shards of one table (a parameter of ``rows x dim``)."""

    def __init__(self, param: torch.Tensor, shards: Sequence[Shard], name: str) -> None:
        self.param = param
        self.name = name
        self.shards = sorted(shards, key=lambda s: s.start)
        self.by_id = {s.shard_id: s for s in self.shards}
        #: The last lookup: its ids (flat), their distinct rows and where each id's row is.
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _split(self, rows: torch.Tensor) -> list[tuple[Shard, int, int]]:
        """For sorted, distinct global ``rows``: each shard with the slice of them it holds."""
        out = []
        for s in self.shards:
            lo = int(torch.searchsorted(rows, s.start))
            hi = int(torch.searchsorted(rows, s.end))
            if hi > lo:
                out.append((s, lo, hi))
        return out

    def rows_to_pull(self, ids: torch.Tensor) -> RowsByServer:
        """The distinct rows ``ids`` looks up, grouped by server and shard (shard-local)."""
        flat = ids.detach().reshape(-1).to(torch.int64)
        rows, inverse = torch.unique(flat, return_inverse=True)
        self._last = (flat, rows, inverse)
        out: RowsByServer = {}
        for s, lo, hi in self._split(rows):
            out.setdefault(s.server, []).append((s.shard_id, rows[lo:hi] - s.start))
        return out

    def store_rows(self, shard_id: int, local_rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write pulled values into the local table."""
        s = self.by_id[shard_id]
        with torch.no_grad():
            self.param.index_copy_(0, local_rows + s.start, values.to(self.param.dtype))

    def gradient_rows(self, grad: torch.Tensor, pulled: dict[int, int]
                      ) -> dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]]:
        """A sparse gradient of the table as pushes per server: ``(shard id, version pulled,
        values, shard-local rows)``; a dense gradient is cut into its nonzero rows."""
        last = self._last
        if grad.is_sparse and not grad.is_coalesced() and last is not None and \
                grad._nnz() == last[0].numel() and torch.equal(grad._indices()[0], last[0]):
            # the gradient of the last lookup: sum duplicates by the lookup's own inverse
            # (a linear pass; coalesce would sort the ids again)
            rows = last[1]
            values = torch.zeros((len(rows), *grad.shape[1:]), dtype=grad.dtype)
            values.index_add_(0, last[2], grad._values())
        elif grad.is_sparse:
            g = grad.coalesce()
            rows, values = g.indices()[0], g.values()
        else:
            rows = torch.nonzero(grad.reshape(len(grad), -1).abs().sum(1)).reshape(-1)
            values = grad.index_select(0, rows)
        out: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
        for s, lo, hi in self._split(rows):
            out.setdefault(s.server, []).append(
                (s.shard_id, pulled.get(s.shard_id, 0), values[lo:hi].contiguous(),
                 (rows[lo:hi] - s.start).contiguous()))
        return out


def is_sparse_table(module: torch.nn.Module) -> bool:
    """An embedding whose gradient torch makes sparse (``sparse=True``)."""
    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and \
        bool(getattr(module, "sparse", False))

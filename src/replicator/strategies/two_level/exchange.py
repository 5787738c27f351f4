"""The outer exchange: the hosts' pseudo-gradients averaged across the slow link, once per host.

Every process of a host holds the same pseudo-gradient, so local rank ``k`` of every host
averages only the ``k``-th of ``L`` chunks with local rank ``k`` of the other hosts (the outer
group), and the host then gathers the chunks over the fast inner group (reduce-scatter /
all-reduce / all-gather, as ``comm/hierarchical.py``). The cross-host step runs on the outer
group's comm lane, overlapped with ``sync_delay`` inner steps: an all-reduce, or with
``int8``/``int4`` an all-gather of quantised payloads decoded and summed in host order on every
member (``comm/block_quantize.py``), so all get the same bits. Under replica groups each
group is one host and the exchange is the live engine's round
(:meth:`OuterExchange.start_in_round`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from replicator.comm.block_quantize import BlockQuantizer
from replicator.comm.collectives import Collectives
from replicator.comm.comm_thread import DONE, Handle, lane

if TYPE_CHECKING:
    from replicator.strategies.live.engine import LiveEngine


@dataclass
class WireStats:
    """What this rank put on the cross-host link: payload bytes handed to the outer
    collectives and the number of exchanges."""

    payload_bytes: int = 0
    exchanges: int = 0


@dataclass
class PendingExchange:
    """An outer exchange in flight: its fragment, handle and (once done) this rank's chunk
    of the hosts' average."""

    fragment: int
    numel: int
    handle: Handle
    box: dict[str, torch.Tensor] = field(default_factory=dict)

    def chunk(self) -> torch.Tensor:
        """This rank's averaged chunk (waits for the exchange, bounded by its timeout)."""
        self.handle.wait()
        self.handle = DONE
        return self.box["chunk"]


@dataclass
class _RoundExchange:
    """A live round's exchange: ``wait()`` ends it (the round's commit) and keeps the chunk."""

    end: Callable[[], torch.Tensor]
    box: dict[str, torch.Tensor]

    def wait(self) -> bool:
        self.box["chunk"] = self.end()
        return True


class OuterExchange:
    """Average flat pseudo-gradients across hosts (see the module doc).

    ``outer_group``: this rank and the ranks of the same local rank on the other hosts
    (``None`` with one host). ``inner``: the collectives of this host's processes.
    ``quantizer``: int8/int4 block quantisation, or ``None`` to send float32.
    """

    def __init__(self, outer_group: dist.ProcessGroup | None, num_hosts: int,
                 inner: Collectives, quantizer: BlockQuantizer | None) -> None:
        self.num_hosts = num_hosts
        self.inner = inner
        self.quantizer = quantizer
        self.stats = WireStats()
        self._lane = lane(outer_group) if num_hosts > 1 and outer_group is not None else None

    def _chunk_of(self, flat: torch.Tensor) -> torch.Tensor:
        size = math.ceil(flat.numel() / self.inner.world_size)
        padded = torch.zeros(size * self.inner.world_size, dtype=flat.dtype, device=flat.device)
        padded[:flat.numel()] = flat
        return padded[self.inner.rank * size:(self.inner.rank + 1) * size].clone()

    def start(self, fragment: int, flat: torch.Tensor) -> PendingExchange:
        """Start averaging ``flat`` (this host's pseudo-gradient of ``fragment``)."""
        mine = self._chunk_of(flat)
        pending = PendingExchange(fragment, flat.numel(), DONE)
        if self._lane is None:
            pending.box["chunk"] = mine
            return pending
        hosts, quantizer, box = self.num_hosts, self.quantizer, pending.box
        group = self._lane.group
        payload = self._payload(mine, fragment)
        if quantizer is None:
            def run() -> None:
                dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=group)
                box["chunk"] = payload.div_(hosts)
        else:
            numel = mine.numel()

            def run() -> None:
                parts = [torch.empty_like(payload) for _ in range(hosts)]
                dist.all_gather(parts, payload, group=group)
                box["chunk"] = quantizer.decode_sum(parts, numel).div_(hosts)

        pending.handle = self._lane.submit(run, f"outer exchange of fragment {fragment}",
                                           payload)
        return pending

    def start_in_round(self, live: LiveEngine, fragment: int, flat: torch.Tensor
                       ) -> PendingExchange:
        """Under replica groups (each one host): start averaging ``flat`` (``fragment``'s
        pseudo-gradient) over the quorum's groups, ended by :meth:`finish` at the live round's
        last step. As across hosts, this rank's chunk goes to the ranks of the same local rank
        in the other groups: a float32 all-reduce, in flight until then, or, quantised, an
        all-gather of payloads decoded and summed in the quorum's order at the round's end
        (started there: DiLoCoStrategy refuses sync_delay with compression in replica groups);
        once the round is committed (else ``StepNotCommitted``) the group gathers the chunks
        over its own processes."""
        mine = self._chunk_of(flat)
        payload = self._payload(mine, fragment)
        pending = PendingExchange(fragment, flat.numel(), DONE)
        quantizer = self.quantizer
        if quantizer is None:
            finish = live.start_round_sync(payload)
        else:
            numel = mine.numel()

            def finish() -> torch.Tensor:
                return live.sync_round_gathered(
                    payload, lambda parts: quantizer.decode_sum(parts, numel))
        pending.handle = _RoundExchange(finish, pending.box)
        return pending

    def _payload(self, mine: torch.Tensor, fragment: int) -> torch.Tensor:
        """What this rank sends of its chunk ``mine`` of ``fragment`` (float32, or quantised
        with the fragment's own error feedback), counted in :attr:`stats`."""
        self.stats.exchanges += 1
        if self.quantizer is None:
            self.stats.payload_bytes += mine.numel() * mine.element_size()
            return mine
        payload = self.quantizer.encode(mine, key=str(fragment))
        self.stats.payload_bytes += payload.numel()
        return payload

    def finish(self, pending: PendingExchange) -> torch.Tensor:
        """The hosts' averaged pseudo-gradient of ``pending``'s fragment, flat (a collective
        over this host's processes)."""
        return self._whole(pending.chunk(), pending.numel)

    def _whole(self, chunk: torch.Tensor, numel: int) -> torch.Tensor:
        """The ``numel`` values whose chunks this host's processes hold (``chunk`` is this
        rank's), gathered over the host's processes."""
        if self.inner.world_size == 1:
            return chunk[:numel]
        full = self.inner.all_gather_uneven(chunk, 0, "outer update gather within the host")
        return full[:numel]

    def state_dict(self) -> dict[str, Any]:
        return {"feedback": {} if self.quantizer is None else self.quantizer.state_dict(),
                "stats": asdict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.quantizer is not None:
            self.quantizer.load_state_dict(dict(state.get("feedback", {})))
        stats = state.get("stats", {})
        self.stats = WireStats(int(stats.get("payload_bytes", 0)), int(stats.get("exchanges", 0)))

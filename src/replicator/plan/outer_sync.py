"""DiLoCo's outer synchronisation in the cost model: what one exchange across the hosts costs,
and the ``inner_steps`` (H) and compression the planner proposes.

Each host sends one copy of the pseudo-gradient (its local ranks take a chunk each; see
``strategies/two_level/exchange.py``): uncompressed, a ring all-reduce of the parameters'
bytes over the hosts; with ``int8``/``int4``, an all-gather of each host's quantised payload
(``comm/block_quantize.payload_bytes``: the values plus a scale per block). Averaged over a
round of H steps, the exchange and the outer optimizer's pass over the weights (pseudo-
gradient, Nesterov update, copy back: about six passes over them) cost ``1/H`` of theirs.

The choice: the smallest H of :data:`INNER_STEPS` (fewer local steps keep training closest to
per-step synchronous training) whose averaged exchange is at most :data:`OUTER_SHARE` of the
inner step, uncompressed where that is enough, else ``int8``, else ``int4``; where none is,
the largest H with ``int4``.
"""

from __future__ import annotations

from dataclasses import dataclass

from replicator.plan.devices import Link
from replicator.plan.formulas import check_count, ring_allreduce_seconds

__all__ = ["INNER_STEPS", "OUTER_SHARE", "OuterSync", "choose_outer_sync", "exchange_cost"]

#: The inner-step counts the planner proposes (the DiLoCo paper trains with 50 to 500).
INNER_STEPS = (10, 20, 50, 100, 200, 500)
#: The most of an inner step the averaged outer exchange may take.
OUTER_SHARE = 0.05
#: Compressions in order of preference (fewer bits lose more of the update).
COMPRESSIONS: tuple[str | None, ...] = (None, "int8", "int4")
_BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class OuterSync:
    """One choice of outer synchronisation and what it costs per inner step."""

    inner_steps: int
    compression: str | None
    seconds_per_step: float   # the exchange and the outer step, averaged over the round
    link_bytes_per_step: float  # bytes a host sends on the link, averaged over the round

    def spelling(self) -> str:
        """The constructor call that runs this choice."""
        extra = f', compression="{self.compression}"' if self.compression else ""
        return f"rp.DiLoCoStrategy(inner_steps={self.inner_steps}{extra})"


def exchange_cost(param_bytes: float, hosts: int, link: Link, compression: str | None,
                  memory_bandwidth: float) -> tuple[float, float]:
    """``(seconds, bytes a host sends)`` of one outer exchange of ``param_bytes`` of fp32
    weights over ``hosts`` hosts, with the outer step's passes over the weights."""
    check_count(hosts, "hosts")
    outer_step = 6 * param_bytes / memory_bandwidth
    if hosts == 1:
        return outer_step, 0.0
    if compression is None:
        sent = 2 * (hosts - 1) / hosts * param_bytes
        return outer_step + ring_allreduce_seconds(param_bytes, hosts, link.bandwidth,
                                                   link.alpha), sent
    from replicator.comm.block_quantize import payload_bytes  # torch: not at the CLI's start

    payload = payload_bytes(max(1, int(param_bytes // 4)), _BITS[compression])
    sent = (hosts - 1) * payload
    coding = 2 * param_bytes / memory_bandwidth * hosts  # quantise once, decode every payload
    return outer_step + coding + sent / link.bandwidth + (hosts - 1) * link.alpha, sent


def choose_outer_sync(inner_step: float, param_bytes: float, hosts: int, link: Link,
                      memory_bandwidth: float) -> OuterSync:
    """The proposed H and compression for an inner step of ``inner_step`` seconds (see the
    module doc)."""
    costs = {comp: exchange_cost(param_bytes, hosts, link, comp, memory_bandwidth)
             for comp in COMPRESSIONS}
    for h in INNER_STEPS:
        for comp in COMPRESSIONS:
            seconds, sent = costs[comp]
            if seconds / h <= OUTER_SHARE * inner_step:
                return OuterSync(h, comp, seconds / h, sent / h)
    h, (seconds, sent) = INNER_STEPS[-1], costs["int4"]
    return OuterSync(h, "int4", seconds / h, sent / h)

"""The alpha-beta formulas the cost model is made of (pure functions of sizes, counts and a
link's figures): collectives' time and bytes, a parameter server's step and queue, and DiLoCo's
outer exchange with the ``inner_steps`` (H) and compression the planner proposes for it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from replicator.plan.devices import Link

__all__ = ["INNER_STEPS", "OUTER_SHARE", "OuterSync", "allreduce_traffic_bytes", "check_count",
           "choose_outer_sync", "exchange_cost", "fsdp_traffic_bytes", "ps_queue_wait",
           "ps_step_seconds", "ring_allreduce_seconds"]


def check_count(n: int, what: str = "workers") -> None:
    """Refuse a count that is not a positive integer (``what`` names it)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{what} must be a positive integer, got {n!r}. HINT: give at least "
                         "1 (one process)")


def ring_allreduce_seconds(nbytes: float, n: int, bandwidth: float, alpha: float) -> float:
    """``2(n-1)/n * S/B + 2(n-1) * alpha``; 0 for one rank."""
    check_count(n, "ranks")
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * alpha


def allreduce_traffic_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce: ``2(n-1)/n * S``."""
    check_count(n, "ranks")
    return 2 * (n - 1) / n * nbytes


def fsdp_traffic_bytes(nbytes: float, n: int, *, gloo: bool = False) -> float:
    """Bytes a rank sends per FSDP step: ``3(n-1)/n * S`` (gloo's reduce-scatter: ``4(n-1)/n``)."""
    check_count(n, "ranks")
    return (4 if gloo else 3) * (n - 1) / n * nbytes


def ps_step_seconds(compute: float, grad_bytes: float, param_bytes: float, workers: int,
                    num_ps: int, bandwidth: float, alpha: float) -> float:
    """A worker's compute and push/pull, at least the servers' share of all workers' traffic."""
    check_count(workers)
    check_count(num_ps, "num_ps")
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    worker = compute + 2 * alpha + (grad_bytes + param_bytes) / bandwidth
    servers = workers * (grad_bytes + param_bytes) / (num_ps * bandwidth)
    return max(worker, servers)


def ps_queue_wait(base_step: float, workers: int, service: float) -> float:
    """The mean wait of a request to a server that ``workers`` keep busy ``service`` seconds
    per push each step: ``W = (sqrt(T^2 + 4 n S^2) - T) / 4`` (docs/planning.md)."""
    if service <= 0 or workers < 2:
        return 0.0  # a lone worker never finds its server busy with another's push
    t = max(0.0, base_step)
    return (math.sqrt(t * t + 4 * workers * service * service) - t) / 4


# -- DiLoCo's outer synchronisation --------------------------------------------------------
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
    """``(seconds, bytes a host sends)`` of one outer exchange and the outer step."""
    check_count(hosts, "hosts")
    outer_step = 6 * param_bytes / memory_bandwidth
    if hosts == 1:
        return outer_step, 0.0
    if compression is None:
        return (outer_step + ring_allreduce_seconds(param_bytes, hosts, link.bandwidth, link.alpha),
                allreduce_traffic_bytes(param_bytes, hosts))
    from replicator.comm.block_quantize import payload_bytes  # torch: not at the CLI's start

    payload = payload_bytes(max(1, int(param_bytes // 4)), _BITS[compression])
    sent = (hosts - 1) * payload
    coding = 2 * param_bytes / memory_bandwidth * hosts  # quantise once, decode every payload
    return outer_step + coding + sent / link.bandwidth + (hosts - 1) * link.alpha, sent


def choose_outer_sync(inner_step: float, param_bytes: float, hosts: int, link: Link,
                      memory_bandwidth: float) -> OuterSync:
    """The smallest H whose averaged exchange is at most :data:`OUTER_SHARE` of the inner step,
    with the least compression that gets there; where none does, the largest H with ``int4``."""
    costs = {comp: exchange_cost(param_bytes, hosts, link, comp, memory_bandwidth)
             for comp in COMPRESSIONS}
    for h in INNER_STEPS:
        for comp in COMPRESSIONS:
            seconds, sent = costs[comp]
            if seconds / h <= OUTER_SHARE * inner_step:
                return OuterSync(h, comp, seconds / h, sent / h)
    h, (seconds, sent) = INNER_STEPS[-1], costs["int4"]
    return OuterSync(h, "int4", seconds / h, sent / h)

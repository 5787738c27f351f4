"""The alpha-beta formulas the cost model is made of: collectives' time and bytes, a parameter
server's step and queue (each a pure function of sizes, counts and a link's figures)."""

from __future__ import annotations

import math

__all__ = ["allreduce_traffic_bytes", "check_count", "fsdp_traffic_bytes", "ps_queue_wait",
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
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * alpha


def allreduce_traffic_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce: ``2(n-1)/n * S``."""
    check_count(n, "ranks")
    return 2 * (n - 1) / n * nbytes


def fsdp_traffic_bytes(nbytes: float, n: int, *, gloo: bool = False) -> float:
    """Bytes each rank sends per FSDP step (two all-gathers, a reduce-scatter):
    ``3(n-1)/n * S``, or ``4(n-1)/n * S`` on gloo (its reduce-scatter sends an all-reduce's)."""
    check_count(n, "ranks")
    return (4 if gloo else 3) * (n - 1) / n * nbytes


def ps_step_seconds(compute: float, grad_bytes: float, param_bytes: float, workers: int,
                    num_ps: int, bandwidth: float, alpha: float) -> float:
    """A worker's compute plus a push/pull round trip (``2 alpha + (G+P)/B``), at least the
    servers' share of every worker's traffic (``workers (G+P) / (num_ps B)``)."""
    check_count(workers)
    check_count(num_ps, "num_ps")
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    worker = compute + 2 * alpha + (grad_bytes + param_bytes) / bandwidth
    servers = workers * (grad_bytes + param_bytes) / (num_ps * bandwidth)
    return max(worker, servers)


def ps_queue_wait(base_step: float, workers: int, service: float) -> float:
    """The mean wait of a request (a push, a batch claim) to a server that ``workers`` keep
    busy ``service`` seconds per push each step: ``W = rho S / 2`` with ``rho = n S / (T +
    2 W)`` gives ``W = (sqrt(T^2 + 4 n S^2) - T) / 4``."""
    if service <= 0 or workers < 2:
        return 0.0  # a lone worker never finds its server busy with another's push
    t = max(0.0, base_step)
    return (math.sqrt(t * t + 4 * workers * service * service) - t) / 4

"""Two-level strategies for hosts joined by a slow link: a synchronous group inside each host,
an outer synchronisation across hosts every H steps (DiLoCo, LocalSGD)."""

from replicator.strategies.two_level.diloco import DiLoCoStrategy, LocalSGDStrategy

__all__ = ["DiLoCoStrategy", "LocalSGDStrategy"]

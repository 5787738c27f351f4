"""A two-level run's per-rank state rides with the input position it belongs to.

Mid-round, the hosts hold different inner weights (and inner optimizer state, and quantisation
errors), so a backup needs them per host, beside the outer weights that all ranks share.
A backup keeps exactly one state per rank: the input's (``dataset.state_dict()``, saved by
every rank; see :mod:`replicator.resume.backup_and_restore`). The dataset that
``DiLoCoStrategy.distribute_dataset`` returns adds the strategy's state to it, so
``rp.BackupAndRestore`` resumes a run mid-round bit for bit with nothing more tracked, and a
custom loop that saves the input state saves the round with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol


class RoundOwner(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TwoLevelDataset:
    """``dataset`` (a distributed dataset) whose state also holds ``owner``'s round state."""

    def __init__(self, dataset: Any, owner: RoundOwner) -> None:
        self.dataset = dataset
        self._owner = owner

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "_owner"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def state_dict(self) -> dict[str, Any]:
        """The input position and the two-level round of this rank."""
        saver = getattr(self.dataset, "state_dict", None)
        if not callable(saver):
            raise TypeError(f"{type(self.dataset).__name__} has no state_dict(), so a backup "
                            "could not resume the round. HINT: give distribute_dataset a "
                            "map-style Dataset or a DataLoader")
        return {"data": saver(), "round": self._owner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["data"])
        self._owner.load_state_dict(state["round"])

    def __repr__(self) -> str:
        return f"TwoLevelDataset({self.dataset!r})"

"""Make every replica fail together when a callback fails on some of them: errors are held
until the next agreement point (the per-step reduction or :meth:`ErrorAgreement.agree`), where
a flag travels with the step's numbers, and then all raise :class:`CallbackFailedError`.
"""

from __future__ import annotations

import traceback

import torch

from replicator.errors import CallbackFailedError

__all__ = ["CallbackFailedError", "ErrorAgreement"]


class ErrorAgreement:
    """Holds this replica's first callback error until the replicas agree on it."""

    def __init__(self, strategy: object) -> None:
        self.strategy = strategy
        self.pending: tuple[str, BaseException] | None = None

    @property
    def flag(self) -> float:
        return 1.0 if self.pending is not None else 0.0

    def hold(self, where: str, exc: BaseException) -> None:
        if self.pending is None:
            self.pending = (where, exc)

    def agree(self) -> None:
        """One small collective: raise on every replica if any holds an error."""
        total = float(self.strategy.reduce("sum", torch.tensor(self.flag)))  # type: ignore
        self.check(total)

    def check(self, flags_total: float) -> None:
        """Raise if ``flags_total`` (the sum of every replica's flag) says someone failed."""
        if flags_total <= 0:
            return
        mine = ""
        if self.pending is not None:
            where, exc = self.pending
            mine = f"{where} raised {type(exc).__name__}: {exc}"
        texts = _gather_text(self.strategy, mine)
        reports = [f"rank {r}: {t}" for r, t in enumerate(texts) if t]
        message = ("a callback failed, so every replica stops: " + "; ".join(reports))
        if self.pending is not None:
            tb = "".join(traceback.format_exception(self.pending[1]))
            raise CallbackFailedError(f"{message}\n{tb}") from self.pending[1]
        raise CallbackFailedError(message)


def _gather_text(strategy: object, text: str) -> list[str]:
    """Every replica's ``text`` (UTF-8 bytes through ``strategy.gather``, no pickling)."""
    data = torch.tensor(list(text.encode()), dtype=torch.int64)
    lengths = strategy.gather(torch.tensor([data.numel()]))  # type: ignore[attr-defined]
    joined = strategy.gather(data).tolist()  # type: ignore[attr-defined]
    out, offset = [], 0
    for n in lengths.tolist():
        out.append(bytes(joined[offset:offset + n]).decode(errors="replace"))
        offset += n
    return out

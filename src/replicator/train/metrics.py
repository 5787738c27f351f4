"""Metrics whose state is a vector of sums, so replicas combine them with one all-reduce.

Each metric accumulates local sums (float64) in :meth:`Metric.update`; its value is computed
from the *reduced* state, so a distributed result equals the one-device result: every sample
counts once, whatever replica saw it, and samples with weight 0 (padding) count not at all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from replicator.comm.reduce_op import ReduceOp


class Metric(ABC):
    """A streaming metric: ``update`` per batch, ``result`` at the end, ``reset`` per epoch."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._state = torch.zeros(self.state_size(), dtype=torch.float64)

    @abstractmethod
    def state_size(self) -> int:
        """Length of the state vector of sums."""

    @abstractmethod
    def _batch_state(self, y_pred: torch.Tensor, y_true: torch.Tensor,
                     weight: torch.Tensor) -> torch.Tensor:
        """The sums one batch adds (``weight`` is per sample, 1 for a real one)."""

    @abstractmethod
    def value_from(self, state: torch.Tensor) -> float:
        """The metric's value for a (reduced) state vector."""

    def update(self, y_pred: torch.Tensor, y_true: torch.Tensor,
               sample_weight: torch.Tensor | None = None) -> None:
        y_pred, y_true = y_pred.detach(), y_true.detach()
        n = y_pred.shape[0] if y_pred.dim() else 1
        weight = torch.ones(n, dtype=torch.float64, device=y_pred.device) \
            if sample_weight is None else sample_weight.detach().to(torch.float64).reshape(-1)
        self._state += self._batch_state(y_pred, y_true, weight).to(torch.float64).cpu()

    @property
    def state(self) -> torch.Tensor:
        return self._state

    def reset(self) -> None:
        self._state.zero_()

    def result(self, strategy: object | None = None) -> float:
        """The value over this replica's samples, or over all replicas' given a strategy
        (a collective: every replica must call it)."""
        state = self._state
        if strategy is not None:
            state = strategy.reduce(ReduceOp.SUM, state).cpu()  # type: ignore[attr-defined]
        return self.value_from(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class Mean(Metric):
    """The weighted mean of the values passed as ``y_pred`` (``y_true`` is ignored)."""

    def __init__(self, name: str = "mean") -> None:
        super().__init__(name)

    def state_size(self) -> int:
        return 2

    def _batch_state(self, y_pred, y_true, weight):
        values = y_pred.reshape(weight.shape[0], -1).to(torch.float64).mean(1)
        return torch.stack([(values * weight).sum(), weight.sum()])

    def update_value(self, value: torch.Tensor | float, count: float = 1.0) -> None:
        """Add an already averaged ``value`` that stands for ``count`` samples."""
        self._state += torch.tensor([float(value) * count, count], dtype=torch.float64)

    def value_from(self, state):
        return float(state[0] / state[1]) if state[1] > 0 else 0.0


class SparseCategoricalAccuracy(Metric):
    """Fraction of samples whose arg-max logit equals the integer label."""

    def __init__(self, name: str = "accuracy") -> None:
        super().__init__(name)

    def state_size(self) -> int:
        return 2

    def _batch_state(self, y_pred, y_true, weight):
        hit = (y_pred.argmax(-1) == y_true.reshape(-1)).to(torch.float64)
        return torch.stack([(hit * weight).sum(), weight.sum()])

    def value_from(self, state):
        return float(state[0] / state[1]) if state[1] > 0 else 0.0


class Accuracy(SparseCategoricalAccuracy):
    """Exact-match accuracy: for logits of several classes the arg-max is compared with the
    label; for one output per sample, ``y_pred > 0.5`` (probabilities) is compared."""

    def _batch_state(self, y_pred, y_true, weight):
        if y_pred.dim() > 1 and y_pred.shape[-1] > 1:
            return super()._batch_state(y_pred, y_true, weight)
        hit = ((y_pred.reshape(-1) > 0.5).to(y_true.dtype) == y_true.reshape(-1))
        hit = hit.to(torch.float64)
        return torch.stack([(hit * weight).sum(), weight.sum()])


class AUC(Metric):
    """Area under the ROC curve for binary labels, from histograms of scores at
    ``num_thresholds`` evenly spaced thresholds in [0, 1] (Keras's approximation).

    ``y_pred`` holds probabilities; pass ``from_logits=True`` for logits.
    """

    def __init__(self, name: str = "auc", num_thresholds: int = 200,
                 from_logits: bool = False) -> None:
        if num_thresholds < 2:
            raise ValueError(f"num_thresholds must be >= 2, got {num_thresholds}")
        self.num_thresholds = num_thresholds
        self.from_logits = from_logits
        super().__init__(name)

    def state_size(self) -> int:
        return 2 * self.num_thresholds

    def _batch_state(self, y_pred, y_true, weight):
        scores = y_pred.reshape(-1).to(torch.float64)
        if self.from_logits:
            scores = torch.sigmoid(scores)
        bins = (scores.clamp(0, 1) * (self.num_thresholds - 1)).round().long().cpu()
        positive = (y_true.reshape(-1) > 0.5).cpu()
        w = weight.cpu()
        pos = torch.zeros(self.num_thresholds, dtype=torch.float64)
        neg = torch.zeros(self.num_thresholds, dtype=torch.float64)
        pos.index_add_(0, bins[positive], w[positive])
        neg.index_add_(0, bins[~positive], w[~positive])
        return torch.cat([pos, neg])

    def value_from(self, state):
        pos, neg = state[: self.num_thresholds], state[self.num_thresholds:]
        if pos.sum() == 0 or neg.sum() == 0:
            return 0.0
        # sweep thresholds from high to low: true/false positive rates
        tpr = torch.cat([torch.zeros(1, dtype=torch.float64), pos.flip(0).cumsum(0) / pos.sum()])
        fpr = torch.cat([torch.zeros(1, dtype=torch.float64), neg.flip(0).cumsum(0) / neg.sum()])
        return float(torch.trapezoid(tpr, fpr))


_BY_NAME = {"accuracy": SparseCategoricalAccuracy, "acc": SparseCategoricalAccuracy,
            "sparse_categorical_accuracy": SparseCategoricalAccuracy, "auc": AUC}


def as_metric(metric: Metric | str) -> Metric:
    """A metric instance from an instance or a name (``"accuracy"``, ``"auc"``)."""
    if isinstance(metric, Metric):
        return metric
    if isinstance(metric, str) and metric.lower() in _BY_NAME:
        return _BY_NAME[metric.lower()]()
    raise ValueError(f"unknown metric {metric!r}; use a replicator.metrics.Metric or one of "
                     f"{', '.join(sorted(_BY_NAME))}")


def reduce_states(strategy: object, metrics: list[Metric],
                  extra: list[float] | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """Sum every metric's state (and ``extra`` numbers) across replicas in ONE collective."""
    parts = [m.state for m in metrics]
    extra = list(extra or [])
    flat = torch.cat(parts + [torch.tensor(extra, dtype=torch.float64)]) if parts or extra \
        else torch.zeros(0, dtype=torch.float64)
    if getattr(strategy, "num_replicas_in_sync", 1) > 1 and flat.numel():
        flat = strategy.reduce(ReduceOp.SUM, flat).cpu().to(torch.float64)  # type: ignore
    out, offset = [], 0
    for m in metrics:
        n = m.state_size()
        out.append(flat[offset:offset + n])
        offset += n
    return out, flat[offset:].tolist()

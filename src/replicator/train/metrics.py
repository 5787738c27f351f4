"""Metrics whose state is a vector of float64 sums, so replicas combine them with one all-reduce
and the value, computed from the reduced state, equals the one-device result (samples of weight
0, padding, count not at all)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from replicator.comm.reduce_op import ReduceOp


class Metric(ABC):
    """A streaming metric: ``update`` per batch, ``result`` at the end, ``reset`` per epoch."""

    def __init__(self, name: str) -> None:
        self.name = name
        #: The vector of sums (float64) this replica's updates added since the last reset.
        self.state = torch.zeros(self.state_size(), dtype=torch.float64)

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
        added = self._batch_state(y_pred, y_true, weight).to(torch.float64).cpu()
        self.state += added  # after _batch_state, which may size the state on first use

    def reset(self) -> None:
        self.state.zero_()

    def load_state(self, state: torch.Tensor) -> None:
        """Set the state vector (e.g. sums restored from a backup)."""
        if state.numel() != self.state.numel():
            raise ValueError(f"{self.name}: a state of {state.numel()} numbers does not fit "
                             f"this metric's {self.state.numel()}")
        self.state = state.to(torch.float64).clone()

    def result(self, strategy: object | None = None) -> float:
        """The value over this replica's samples, or over all replicas' given a strategy
        (a collective: every replica must call it)."""
        return self.value_from(self.state if strategy is None else
                               strategy.reduce(ReduceOp.SUM, self.state).cpu())  # type: ignore

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class _WeightedMean(Metric):
    """A weighted mean of one number per sample: the state is (weighted sum, total weight)."""

    def state_size(self) -> int:
        return 2

    @abstractmethod
    def _per_sample(self, y_pred: torch.Tensor, y_true: torch.Tensor, n: int) -> torch.Tensor:
        """One number per sample (``n`` of them)."""

    def _batch_state(self, y_pred, y_true, weight):
        values = self._per_sample(y_pred, y_true, weight.shape[0]).to(torch.float64)
        return torch.stack([(values * weight).sum(), weight.sum()])

    def value_from(self, state):
        return float(state[0] / state[1]) if state[1] > 0 else 0.0


class Mean(_WeightedMean):
    """The weighted mean of the values passed as ``y_pred`` (``y_true`` is ignored)."""

    def __init__(self, name: str = "mean") -> None:
        super().__init__(name)

    def _per_sample(self, y_pred, y_true, n):
        return y_pred.reshape(n, -1).to(torch.float64).mean(1)

    def update_value(self, value: torch.Tensor | float, count: float = 1.0) -> None:
        """Add an already averaged ``value`` that stands for ``count`` samples."""
        self.state += torch.tensor([float(value) * count, count], dtype=torch.float64)


class SparseCategoricalAccuracy(_WeightedMean):
    """Fraction of samples whose arg-max logit equals the integer label."""

    def __init__(self, name: str = "accuracy") -> None:
        super().__init__(name)

    def _per_sample(self, y_pred, y_true, n):
        return y_pred.argmax(-1) == y_true.reshape(-1)


def _is_binary_labels(y: torch.Tensor) -> bool:
    return bool(((y == 0) | (y == 1)).all()) if y.numel() else True


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


class Accuracy(SparseCategoricalAccuracy):
    """Accuracy that picks binary or categorical from the shapes, as Keras's ``"accuracy"``:
    ``[N]``/``[N, 1]`` outputs with 0/1 targets are binary (``> threshold``, or its log-odds
    ``from_logits``); ``[N, C]`` with integer or one-hot targets, and ``[N, C, ...]`` with
    ``[N, ...]`` integer targets, take the arg-max. ``from_logits=None``: set by a Trainer."""

    def __init__(self, name: str = "accuracy", threshold: float = 0.5,
                 from_logits: bool | None = None) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        self.threshold, self.from_logits = threshold, from_logits
        super().__init__(name)

    def _binary_hits(self, y_pred: torch.Tensor, y_true: torch.Tensor) -> torch.Tensor:
        scores, labels = y_pred.reshape(-1), y_true.reshape(-1)
        if not _is_binary_labels(labels):
            raise ValueError(
                f"{self.name}: a one-output model ({_shape(y_pred)}) needs 0/1 targets, got "
                f"values such as {labels[(labels != 0) & (labels != 1)][:3].tolist()}. HINT: "
                "for several classes the model needs one output per class ([N, C]).")
        if self.from_logits:
            cut = math.log(self.threshold / (1.0 - self.threshold))
        else:
            if scores.numel() and (scores.min() < 0 or scores.max() > 1):
                raise ValueError(
                    f"{self.name}: binary outputs must be probabilities in [0, 1] but range "
                    f"from {float(scores.min()):.3g} to {float(scores.max()):.3g}. HINT: for "
                    "logits pass rp.metrics.Accuracy(from_logits=True) (the Trainer does so "
                    "for BCEWithLogitsLoss), or end the model with a sigmoid.")
            cut = self.threshold
        return ((scores > cut).to(torch.float64) == labels.to(torch.float64)).to(torch.float64)

    def _per_sample(self, y_pred, y_true, n):
        if y_pred.dim() == 2 and y_pred.shape[1] > 1 and y_true.dim() == 2 \
                and y_true.shape[1] == 1 and not y_true.is_floating_point():
            y_true = y_true.reshape(-1)  # integer labels as a column
        if y_pred.dim() == 1 or (y_pred.dim() == 2 and y_pred.shape[1] == 1):
            if y_true.numel() != n:
                raise ValueError(f"{self.name}: outputs {_shape(y_pred)} need one target per "
                                 f"sample, got targets {_shape(y_true)}")
            return self._binary_hits(y_pred, y_true)
        if y_pred.shape == y_true.shape and y_pred.dim() == 2:
            return y_pred.argmax(1) == y_true.argmax(1)
        if y_pred.dim() == y_true.dim() + 1 and y_pred.shape[0] == y_true.shape[0] \
                and y_pred.shape[2:] == y_true.shape[1:] and not y_true.is_floating_point():
            return (y_pred.argmax(1) == y_true).to(torch.float64).reshape(n, -1).mean(1)
        raise ValueError(
            f"{self.name}: cannot tell binary from categorical for outputs {_shape(y_pred)} and "
            f"targets {_shape(y_true)}. HINT: binary needs outputs [N] or [N, 1] with 0/1 targets; "
            "categorical needs [N, C] outputs with integer targets [N] or one-hot targets [N, C].")


class AUC(Metric):
    """Area under the ROC curve from score histograms at ``num_thresholds`` thresholds (Keras's
    approximation), exact across replicas. Binary (``[N]``, ``[N, 1]``, ``[N, 2]``) or
    multi-class one-vs-rest, averaged ``"macro"`` or ``"weighted"`` as scikit-learn's;
    ``num_classes`` or the first batch; ``from_logits=None``: set by a Trainer."""

    def __init__(self, name: str = "auc", num_thresholds: int = 200,
                 from_logits: bool | None = None, num_classes: int | None = None,
                 multi_class: str = "ovr", average: str = "macro") -> None:
        if num_thresholds < 2:
            raise ValueError(f"num_thresholds must be >= 2, got {num_thresholds}")
        if multi_class != "ovr":
            raise ValueError(f"multi_class={multi_class!r} is not supported; use 'ovr' "
                             "(one class against the rest)")
        if average not in ("macro", "weighted"):
            raise ValueError(f"average must be 'macro' or 'weighted', got {average!r}")
        if num_classes is not None and num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.num_thresholds, self.from_logits = num_thresholds, from_logits
        self.multi_class, self.average = multi_class, average
        # one histogram pair for binary scores, one per class for multi-class
        self._curves: int | None = None if num_classes is None else (
            1 if num_classes == 2 else num_classes)
        super().__init__(name)

    def state_size(self) -> int:
        return 2 * self.num_thresholds * (self._curves or 1)

    def _set_curves(self, curves: int) -> None:
        if self._curves is None:
            self._curves = curves
            if curves != 1:
                if bool(self.state.any()):
                    raise ValueError(f"{self.name}: the number of classes changed after "
                                     "updates; give num_classes")
                self.state = torch.zeros(self.state_size(), dtype=torch.float64)
        elif self._curves != curves:
            raise ValueError(f"{self.name}: outputs with {curves if curves > 1 else 2} classes "
                             f"after outputs with {self._curves if self._curves > 1 else 2}; "
                             "every batch needs the same number of classes")

    def load_state(self, state: torch.Tensor) -> None:
        """Set the state vector (its length tells the number of classes)."""
        curves = state.numel() // (2 * self.num_thresholds)
        if curves * 2 * self.num_thresholds != state.numel() or curves < 1:
            raise ValueError(f"{self.name}: a state of {state.numel()} numbers does not fit "
                             f"{self.num_thresholds} thresholds")
        self._curves = curves
        self.state = state.to(torch.float64).clone()

    def _scores_and_labels(self, y_pred: torch.Tensor,
                           y_true: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores ``[N, K]`` in [0, 1] and 0/1 labels ``[N, K]``, K curves (1 for binary)."""
        p = y_pred.to(torch.float64)
        n = p.shape[0] if p.dim() else 1
        if p.dim() == 1 or (p.dim() == 2 and p.shape[1] == 1):
            scores = torch.sigmoid(p.reshape(n, 1)) if self.from_logits else p.reshape(n, 1)
            labels = y_true.reshape(n, 1)
        elif p.dim() == 2 and p.shape[1] == 2 and (y_true.dim() == 1 or y_true.shape == p.shape):
            probs = torch.softmax(p, 1) if self.from_logits else p
            scores = probs[:, 1:]
            labels = (y_true.reshape(n) if y_true.dim() == 1 else y_true[:, 1]).reshape(n, 1)
        elif p.dim() == 2 and (y_true.shape == p.shape or (
                y_true.dim() == 1 and not y_true.is_floating_point())):
            scores = torch.softmax(p, 1) if self.from_logits else p
            if y_true.dim() == 1:
                if y_true.numel() and (y_true.min() < 0 or y_true.max() >= p.shape[1]):
                    raise ValueError(f"{self.name}: labels must be in [0, {p.shape[1]}) for "
                                     f"outputs {_shape(y_pred)}")
                labels = torch.nn.functional.one_hot(y_true.long(), p.shape[1])
            else:
                labels = y_true
        else:
            raise ValueError(
                f"{self.name}: outputs {_shape(y_pred)} with targets {_shape(y_true)} are "
                "neither binary ([N], [N, 1], [N, 2] with 0/1 targets) nor multi-class "
                "([N, C] with integer targets [N] or one-hot targets [N, C])")
        if not _is_binary_labels(labels):
            raise ValueError(f"{self.name}: targets must be 0/1 (or class indices), got values "
                             "outside {0, 1}")
        if not self.from_logits and scores.numel() and (scores.min() < 0 or scores.max() > 1):
            raise ValueError(
                f"{self.name}: scores must be probabilities in [0, 1] but range from "
                f"{float(scores.min()):.3g} to {float(scores.max()):.3g}. HINT: for logits pass "
                "rp.metrics.AUC(from_logits=True) (the Trainer does so for CrossEntropyLoss "
                "and BCEWithLogitsLoss).")
        return scores, labels

    def _batch_state(self, y_pred, y_true, weight):
        scores, labels = self._scores_and_labels(y_pred, y_true)
        self._set_curves(scores.shape[1])
        t, k = self.num_thresholds, scores.shape[1]
        bins = (scores.clamp(0, 1) * (t - 1)).round().long().cpu()
        positive = (labels > 0.5).cpu()
        w = weight.cpu().reshape(-1, 1).expand(-1, k)
        index = (bins + torch.arange(k).reshape(1, k) * t).reshape(-1)  # curve j's bins from j * t
        pos, neg = torch.zeros(2, k * t, dtype=torch.float64)
        pos.index_add_(0, index, (w * positive).reshape(-1))
        neg.index_add_(0, index, (w * ~positive).reshape(-1))
        # state layout: for each curve, its positive then its negative histogram
        return torch.cat([pos.reshape(k, t), neg.reshape(k, t)], 1).reshape(-1)

    def value_from(self, state):
        t = self.num_thresholds
        values, weights = [], []
        for curve in state.reshape(-1, 2 * t):
            pos, neg = curve[:t], curve[t:]
            if pos.sum() == 0 or neg.sum() == 0:
                continue  # a class absent (or present everywhere): its ROC is undefined
            # sweep thresholds from high to low: true/false positive rates
            zero = torch.zeros(1, dtype=torch.float64)
            tpr = torch.cat([zero, pos.flip(0).cumsum(0) / pos.sum()])
            fpr = torch.cat([zero, neg.flip(0).cumsum(0) / neg.sum()])
            values.append(float(torch.trapezoid(tpr, fpr)))
            weights.append(float(pos.sum()) if self.average == "weighted" else 1.0)
        return sum(v * w for v, w in zip(values, weights)) / sum(weights) if values else 0.0


_BY_NAME = {"accuracy": Accuracy, "acc": Accuracy,
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
    flat = torch.cat([*(m.state for m in metrics), torch.tensor(extra or [], dtype=torch.float64)])
    if getattr(strategy, "num_replicas_in_sync", 1) > 1 and flat.numel():
        flat = strategy.reduce(ReduceOp.SUM, flat).cpu().to(torch.float64)  # type: ignore
    sizes = [m.state_size() for m in metrics]
    *states, rest = flat.split([*sizes, flat.numel() - sum(sizes)])
    return states, rest.tolist()

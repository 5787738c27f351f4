"""Metrics against scikit-learn on random data: accuracy (binary and categorical, chosen from
the shapes) and AUC (binary and one-vs-rest multi-class), streamed in batches, weighted, and
summed over replicas (states added as the all-reduce adds them)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from sklearn.metrics import accuracy_score, roc_auc_score
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp

N = 997  # not a multiple of the batch size


def _stream(metric: rp.metrics.Metric, pred: torch.Tensor, y: torch.Tensor,
            weight: torch.Tensor | None = None, batch: int = 64) -> float:
    """Update in batches, as two "replicas" taking alternate batches, and sum their states."""
    replicas = [metric, copy.deepcopy(metric)]
    for i, start in enumerate(range(0, len(y), batch)):
        part = slice(start, start + batch)
        w = None if weight is None else weight[part]
        replicas[i % 2].update(pred[part], y[part], w)
    return metric.value_from(replicas[0].state + replicas[1].state)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _binary(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, 2, (N,), generator=gen)
    logits = torch.randn(N, generator=gen) + 2.5 * (y - 0.5)
    return logits, y


@pytest.mark.parametrize("shape", ["[N]", "[N,1]"])
def test_accuracy_binary_probabilities_matches_sklearn(gen, shape):
    logits, y = _binary(gen)
    prob = torch.sigmoid(logits)
    expected = accuracy_score(y.numpy(), (prob > 0.5).long().numpy())
    assert expected > 0.8  # a well-separated problem, so 0.0 or 0.4 would be plainly wrong
    pred, target = (prob, y) if shape == "[N]" else (prob[:, None], y[:, None].float())
    assert _stream(rp.metrics.Accuracy(), pred, target) == pytest.approx(expected, abs=1e-12)
    # the name "accuracy" is the same metric
    named = rp.Trainer(rp.OneDeviceStrategy("cpu"), nn.Linear(3, 1),
                       torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1),
                       nn.BCELoss(), metrics=["accuracy"]).metrics[0]
    assert isinstance(named, rp.metrics.Accuracy) and named.from_logits is False
    assert _stream(named, pred, target) == pytest.approx(expected, abs=1e-12)


def test_accuracy_binary_logits_and_threshold(gen):
    logits, y = _binary(gen)
    expected = accuracy_score(y.numpy(), (logits > 0).long().numpy())
    metric = rp.metrics.Accuracy(from_logits=True)
    assert _stream(metric, logits, y) == pytest.approx(expected, abs=1e-12)
    high = accuracy_score(y.numpy(), (torch.sigmoid(logits) > 0.8).long().numpy())
    metric = rp.metrics.Accuracy(threshold=0.8, from_logits=True)
    assert _stream(metric, logits, y) == pytest.approx(high, abs=1e-12)
    # logits given as probabilities: a clear error, not a silently wrong number
    with pytest.raises(ValueError, match="from_logits=True"):
        rp.metrics.Accuracy().update(logits, y)


def test_trainer_takes_logits_from_its_loss(gen):
    def trainer(loss: nn.Module, metric: str | rp.metrics.Metric) -> rp.metrics.Metric:
        model = nn.Linear(3, 1)
        return rp.Trainer(rp.OneDeviceStrategy("cpu"), model,
                          torch.optim.SGD(model.parameters(), lr=0.1), loss,
                          metrics=[metric]).metrics[0]

    assert trainer(nn.BCEWithLogitsLoss(), "accuracy").from_logits is True
    assert trainer(nn.CrossEntropyLoss(), rp.metrics.AUC()).from_logits is True
    assert trainer(nn.BCELoss(), rp.metrics.AUC()).from_logits is False
    assert trainer(nn.BCEWithLogitsLoss(), rp.metrics.AUC(from_logits=False)).from_logits is False
    assert trainer(nn.MSELoss(), "accuracy").from_logits is None


def test_accuracy_categorical_matches_sklearn(gen):
    logits = torch.randn(N, 7, generator=gen)
    y = torch.randint(0, 7, (N,), generator=gen)
    logits[torch.arange(N), y] += 1.0
    expected = accuracy_score(y.numpy(), logits.argmax(1).numpy())
    assert _stream(rp.metrics.Accuracy(), logits, y) == pytest.approx(expected, abs=1e-12)
    assert _stream(rp.metrics.Accuracy(), logits, y[:, None]) == pytest.approx(expected,
                                                                             abs=1e-12)
    one_hot = torch.nn.functional.one_hot(y, 7).float()
    assert _stream(rp.metrics.Accuracy(), logits, one_hot) == pytest.approx(expected, abs=1e-12)
    # [N, 2] outputs with 0/1 targets are categorical: arg-max of the two scores
    two = logits[:, :2]
    yb = (y % 2)
    assert _stream(rp.metrics.Accuracy(), two, yb) == pytest.approx(
        accuracy_score(yb.numpy(), two.argmax(1).numpy()), abs=1e-12)


def test_accuracy_weights_and_padding(gen):
    logits = torch.randn(N, 4, generator=gen)
    y = torch.randint(0, 4, (N,), generator=gen)
    w = torch.rand(N, generator=gen)
    w[::5] = 0.0  # padding counts not at all
    expected = accuracy_score(y.numpy(), logits.argmax(1).numpy(), sample_weight=w.numpy())
    assert _stream(rp.metrics.Accuracy(), logits, y, w) == pytest.approx(expected, abs=1e-12)


def test_accuracy_ambiguous_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="0/1 targets"):
        rp.metrics.Accuracy().update(torch.rand(8), torch.arange(8))
    with pytest.raises(ValueError, match="cannot tell binary from categorical"):
        rp.metrics.Accuracy().update(torch.rand(8, 3), torch.zeros(8, 2))


@pytest.mark.parametrize("shape", ["[N]", "[N,1]", "[N,2]"])
def test_auc_binary_matches_sklearn(gen, shape):
    logits, y = _binary(gen)
    prob = torch.sigmoid(logits)
    expected = roc_auc_score(y.numpy(), prob.numpy())
    if shape == "[N]":
        pred, metric = prob, rp.metrics.AUC(num_thresholds=2000)
    elif shape == "[N,1]":
        pred, metric = logits[:, None], rp.metrics.AUC(num_thresholds=2000, from_logits=True)
    else:  # two logits whose softmax gives the same probability
        pred = torch.stack([torch.zeros(N), logits], 1)
        metric = rp.metrics.AUC(num_thresholds=2000, from_logits=True)
    # thresholds 1/2000 apart: the histogram approximation is within about that much
    assert _stream(metric, pred, y) == pytest.approx(expected, abs=2e-3)


@pytest.mark.parametrize("average", ["macro", "weighted"])
def test_auc_multiclass_one_vs_rest_matches_sklearn(gen, average):
    c = 5
    y = torch.randint(0, c, (N,), generator=gen)
    y[:300][y[:300] == 4] = 0  # uneven class sizes, so "weighted" differs from "macro"
    logits = torch.randn(N, c, generator=gen)
    logits[torch.arange(N), y] += 1.0
    prob = torch.softmax(logits, 1)
    expected = roc_auc_score(y.numpy(), prob.numpy(), multi_class="ovr", average=average)
    metric = rp.metrics.AUC(num_thresholds=2000, from_logits=True, average=average)
    assert _stream(metric, logits, y) == pytest.approx(expected, abs=2e-3)
    # probabilities and one-hot targets give the same
    metric = rp.metrics.AUC(num_thresholds=2000, average=average, num_classes=c)
    one_hot = torch.nn.functional.one_hot(y, c)
    assert _stream(metric, prob, one_hot) == pytest.approx(expected, abs=2e-3)


def test_auc_bad_input_is_a_clear_error(gen):
    with pytest.raises(ValueError, match="from_logits=True"):
        rp.metrics.AUC().update(torch.randn(8) * 5, torch.randint(0, 2, (8,)))
    with pytest.raises(ValueError, match="'ovr'"):
        rp.metrics.AUC(multi_class="ovo")
    with pytest.raises(ValueError, match="labels must be in"):
        rp.metrics.AUC().update(torch.rand(4, 3), torch.tensor([0, 1, 2, 3]))
    auc = rp.metrics.AUC(from_logits=True)
    auc.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
    with pytest.raises(ValueError, match="same number of classes"):
        auc.update(torch.randn(4, 4), torch.tensor([0, 1, 2, 3]))


def test_fit_with_accuracy_and_auc_on_a_multiclass_model():
    """The README's case: CrossEntropyLoss with "accuracy" and AUC() just works."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=gen)
    y = x[:, :3].argmax(1)
    data = DataLoader(TensorDataset(x, y), batch_size=32)
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    trainer = rp.Trainer(rp.OneDeviceStrategy("cpu"), model,
                         torch.optim.Adam(model.parameters(), lr=0.05), nn.CrossEntropyLoss(),
                         metrics=["accuracy", rp.metrics.AUC()])
    history = trainer.fit(data, epochs=3, validation_data=data, verbose=0)
    scores = trainer.evaluate(data)
    with torch.no_grad():
        logits = model(x)
    assert scores["accuracy"] == pytest.approx(
        accuracy_score(y.numpy(), logits.argmax(1).numpy()), abs=1e-9)
    assert scores["auc"] == pytest.approx(roc_auc_score(
        y.numpy(), torch.softmax(logits, 1).numpy(), multi_class="ovr"), abs=1e-2)
    assert history.history["val_auc"][-1] == pytest.approx(scores["auc"], abs=1e-12)

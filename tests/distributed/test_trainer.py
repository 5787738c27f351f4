"""Trainer.fit / evaluate / predict: the same numbers under OneDevice and Mirrored(2)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import replicator as rp
from replicator.testing import assert_params_close, run_distributed
from tests.train_helpers import digits, loader, make_trainer


def fit_evaluate_predict(strategy_name: str) -> dict:
    strategy = rp.get_strategy(strategy_name)
    train, test = digits()
    trainer = make_trainer(strategy)
    history = trainer.fit(loader(train), epochs=3, validation_data=loader(test, 64, False),
                          verbose=0)
    # 1,001 samples with global batch 32: not a multiple of the batch nor of the replicas
    big = TensorDataset(*train[:1001])
    scores = trainer.evaluate(loader(big, 32, False))
    preds = trainer.predict(loader(big, 32, False))
    return {"state": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "history": history.history, "epochs": history.epoch, "eval": scores,
            "preds": preds, "rank": strategy.replica_id}


@pytest.mark.timeout(150)
def test_fit_evaluate_predict_match_one_device():
    ref = run_distributed(fit_evaluate_predict, 1, args=("one_device",))[0]
    out = run_distributed(fit_evaluate_predict, 2, args=("mirrored",))
    assert ref["epochs"] == [0, 1, 2]
    assert ref["history"]["accuracy"][-1] > ref["history"]["accuracy"][0]
    for rank_out in out:
        assert_params_close(ref["state"], rank_out["state"], atol=1e-5)
        assert rank_out["epochs"] == ref["epochs"]
        assert set(rank_out["history"]) == {"loss", "accuracy", "val_loss", "val_accuracy"}
        for key, values in ref["history"].items():
            assert rank_out["history"][key] == pytest.approx(values, abs=1e-5), key
        assert rank_out["eval"]["accuracy"] == ref["eval"]["accuracy"]  # counts are exact
        assert rank_out["eval"]["loss"] == pytest.approx(ref["eval"]["loss"], abs=1e-6)
        assert rank_out["preds"].shape == (1001, 10)
        assert torch.allclose(rank_out["preds"], ref["preds"], atol=1e-5)  # dataset order


class RaiseOnChief(rp.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.is_chief and self.trainer.global_step == 3:
            raise RuntimeError("chief-only callback failure")


def fit_with_failing_callback(_: int) -> None:
    strategy = rp.MirroredStrategy()
    train, _ = digits(256)
    make_trainer(strategy).fit(loader(train), epochs=2, callbacks=[RaiseOnChief()], verbose=0)


@pytest.mark.timeout(60)
def test_callback_failing_on_chief_only_stops_every_rank():
    with pytest.raises(rp.WorkerFailedError) as info:
        run_distributed(fit_with_failing_callback, 2, args=(0,), timeout_seconds=30)
    text = str(info.value)
    assert "CallbackFailedError" in text
    assert "rank 0: on_train_batch_end raised RuntimeError: chief-only callback failure" in text
    # both ranks stopped with that error (whichever exited first is reported first), not
    # with a lost-connection error
    failed_first = info.value.rank
    other = 1 - failed_first
    assert f"rank {failed_first} failed (exit code 1): CallbackFailedError" in text
    assert f"rank {other}: CallbackFailedError" in text


def replicator_facade(_: int) -> list:
    strategy = rp.MirroredStrategy()
    data = torch.arange(12.0).reshape(12, 1)

    def input_fn(ctx):
        shard = rp.data.shard(TensorDataset(data), ctx.num_input_pipelines,
                              ctx.input_pipeline_id)
        return torch.utils.data.DataLoader(shard, batch_size=ctx.get_per_replica_batch_size(4))

    def step_fn(batch):
        return batch[0].sum()

    return [float(v) for v in rp.Replicator(strategy).run(input_fn, step_fn, num_steps=5)]


@pytest.mark.timeout(60)
def test_replicator_facade_runs_input_fn_and_step_fn():
    a, b = run_distributed(replicator_facade, 2, args=(0,))
    # shards: rank 0 has 0,2,4,...; rank 1 has 1,3,5,...; batch 2 each; mean over replicas
    assert a == b == [3.0, 11.0, 19.0, 3.0, 11.0]


def short_fit(strategy_name: str) -> dict:
    strategy = rp.get_strategy(strategy_name)
    train, _ = digits(330)  # 330 = 10 full global batches of 32 + a short one of 10
    trainer = make_trainer(strategy)
    history = trainer.fit(loader(train), epochs=2, verbose=0)
    return {"state": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "history": history.history}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy_name", ["multi_worker_mirrored", "central_storage"])
def test_trainer_runs_unchanged_under_other_strategies(strategy_name):
    ref = run_distributed(short_fit, 1, args=("one_device",))[0]
    out = run_distributed(short_fit, 2, args=(strategy_name,))[0]
    assert_params_close(ref["state"], out["state"], atol=1e-5)
    assert out["history"]["loss"] == pytest.approx(ref["history"]["loss"], abs=1e-5)


class InjectFault(rp.Callback):
    def __init__(self, fault) -> None:
        self.fault = fault

    def on_train_batch_end(self, batch, logs=None):
        self.fault(self.trainer.global_step)


def fit_with_backup(backup_dir: str, kill: bool) -> dict:
    from replicator.resume import BackupAndRestore
    from replicator.testing import kill_rank

    strategy = rp.MirroredStrategy()
    train, test = digits(330)  # 11 steps per epoch with global batch 32
    trainer = make_trainer(strategy)
    callbacks = [BackupAndRestore(backup_dir, save_freq=5)]
    if kill:
        callbacks.append(InjectFault(kill_rank(1, at_step=16)))  # epoch 2, once
    history = trainer.fit(loader(train), epochs=3, validation_data=loader(test, 64, False),
                          callbacks=callbacks, verbose=0)
    return {"state": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "history": history.history, "epochs": history.epoch,
            "steps": trainer.global_step}


@pytest.mark.timeout(180)
def test_killed_rank_resumes_fit_to_the_same_weights_and_history(tmp_path):
    ref = run_distributed(fit_with_backup, 2, args=(str(tmp_path / "a"), False))[0]
    out = run_distributed(fit_with_backup, 2, args=(str(tmp_path / "b"), True),
                          max_restarts=1)[0]
    assert out["steps"] == ref["steps"] == 33
    assert out["epochs"] == ref["epochs"] == [0, 1, 2]
    assert_params_close(ref["state"], out["state"], atol=1e-6)
    for key, values in ref["history"].items():
        assert out["history"][key] == pytest.approx(values, abs=1e-6), key


def evaluate_binary_and_multiclass(strategy_name: str) -> dict:
    """Accuracy and AUC of fixed models over 1,001 samples (uneven across replicas)."""
    strategy = rp.get_strategy(strategy_name)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1001, 6, generator=g)
    y_bin = (x[:, 0] + 0.5 * torch.randn(1001, generator=g) > 0).long()
    y_multi = (x[:, :4] + 0.8 * torch.randn(1001, 4, generator=g)).argmax(1)
    torch.manual_seed(0)
    binary = torch.nn.Sequential(torch.nn.Linear(6, 1), torch.nn.Sigmoid())
    with torch.no_grad():
        binary[0].weight.copy_(torch.tensor([[2.0, 0.3, 0, 0, 0, 0]]))
    multi = torch.nn.Linear(6, 4)
    with torch.no_grad():
        multi.weight.copy_(torch.eye(4, 6) * 2)
    out = {}
    for name, model, y, loss in (("binary", binary, y_bin[:, None].float(), torch.nn.BCELoss()),
                                 ("multi", multi, y_multi, torch.nn.CrossEntropyLoss())):
        trainer = rp.Trainer(strategy, model, torch.optim.SGD(model.parameters(), lr=0.0), loss,
                             metrics=["accuracy", rp.metrics.AUC(num_thresholds=1000)])
        out[name] = trainer.evaluate(loader(TensorDataset(x, y), 64, False))
        out[name + "_pred"] = trainer.predict(loader(TensorDataset(x, y), 64, False))
    out["y_bin"], out["y_multi"] = y_bin, y_multi
    return out


@pytest.mark.timeout(120)
def test_accuracy_and_auc_are_exact_across_replicas():
    from sklearn.metrics import accuracy_score, roc_auc_score

    ref = run_distributed(evaluate_binary_and_multiclass, 1, args=("one_device",))[0]
    out = run_distributed(evaluate_binary_and_multiclass, 2, args=("mirrored",))
    for rank_out in out:  # every replica reports the same numbers as one device
        for name in ("binary", "multi"):
            assert rank_out[name]["accuracy"] == ref[name]["accuracy"]
            assert rank_out[name]["auc"] == pytest.approx(ref[name]["auc"], abs=1e-12)
    prob = ref["binary_pred"].reshape(-1)
    assert ref["binary"]["accuracy"] == pytest.approx(
        accuracy_score(ref["y_bin"], (prob > 0.5).long()), abs=1e-12)
    assert ref["binary"]["accuracy"] > 0.7
    assert ref["binary"]["auc"] == pytest.approx(roc_auc_score(ref["y_bin"], prob), abs=2e-3)
    logits = ref["multi_pred"]
    assert ref["multi"]["accuracy"] == pytest.approx(
        accuracy_score(ref["y_multi"], logits.argmax(1)), abs=1e-12)
    assert ref["multi"]["auc"] == pytest.approx(roc_auc_score(
        ref["y_multi"], torch.softmax(logits, 1), multi_class="ovr"), abs=2e-3)

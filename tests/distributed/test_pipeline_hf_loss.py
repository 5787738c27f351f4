"""A Hugging Face language model's own loss under a pipeline: the training script written for
one device (``loss = model(input_ids=x, labels=labels).loss; loss.backward()``) runs unchanged
under ``PipelineStrategy(num_stages=2)`` on a tied GPT-2 and equals one device (AdamW, 5e-5),
labels masked with -100 included (the mean counts the whole batch's tokens, not each
microbatch's)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import replicator as rp
from replicator.testing import assert_params_close, run_distributed
from tests.distributed.model_parallel_models import (
    GLOBAL_BATCH,
    TIED_SEQ,
    TIED_VOCAB,
    full_state,
    make_tied_gpt2,
    token_data,
)

STEPS = 5


def _script(kind: str) -> dict:
    """The user's script: AdamW steps on the model's own loss; the reported losses, the
    loss of an evaluation under ``torch.no_grad()`` and the parameters this rank holds."""
    strategy = rp.OneDeviceStrategy("cpu") if kind == "one_device" else \
        rp.PipelineStrategy(num_stages=2, num_microbatches=4)
    with strategy.scope():
        model = make_tied_gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, eps=1e-6)

    def labels_of(x: torch.Tensor) -> torch.Tensor:
        # the first rows of the batch have more ignored tokens than the last ones
        rows = torch.arange(x.shape[0]).unsqueeze(1)
        return torch.where((x % 5 == 0) & (rows < x.shape[0] // 2), -100, x)

    def step(batch: tuple) -> torch.Tensor:
        x, _ = batch
        loss = model(input_ids=x, labels=labels_of(x)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    data = DataLoader(token_data(vocab=TIED_VOCAB, seq=TIED_SEQ), batch_size=GLOBAL_BATCH,
                      shuffle=True)
    it = iter(strategy.distribute_dataset(data, seed=3))
    losses = [float(strategy.reduce("mean", strategy.run(step, args=(next(it),))))
              for _ in range(STEPS)]
    x, _ = next(it)
    with torch.no_grad():
        out = model(input_ids=x, labels=labels_of(x))
    return {"losses": losses, "eval": float(out.loss), "logits": out.logits is not None,
            "state": full_state(strategy, model)}


@pytest.mark.timeout(240)
def test_hf_own_loss_under_pipeline_equals_one_device() -> None:
    pytest.importorskip("transformers")
    one = run_distributed(_script, 1, args=("one_device",), timeout_seconds=120)[0]
    ranks = run_distributed(_script, 2, args=("pipeline",), timeout_seconds=120)
    start = make_tied_gpt2().state_dict()
    assert all(not torch.equal(start[k], v) for k, v in one["state"].items())  # it trains
    for rank, got in enumerate(ranks):  # the loss is reported on every rank of the pipeline
        assert got["losses"] == pytest.approx(one["losses"], abs=1e-5), rank
        assert got["eval"] == pytest.approx(one["eval"], abs=1e-5), rank
    assert [r["logits"] for r in ranks] == [False, True]  # the logits stay on the last stage
    merged = {**ranks[0]["state"], **ranks[1]["state"]}
    assert set(merged) == set(one["state"])
    assert_params_close(one["state"], merged, atol=5e-5, label="pipeline x2 vs one device: ")

"""Tied weights across pipeline stages: a Hugging Face GPT-2 with its output head tied to the
token embedding, cut so the first and last stage both use it, equals one device (pipeline 2,
interleaved, one schedule run, gradient accumulation, data 2 x pipeline 2); its copies stay
equal, the full state dict holds it once, and a hung holder is named."""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import replicator as rp
from replicator.parallel.pipeline import PipelineRunner
from replicator.parallel.pipeline_split import build_stages, flatten_chain, shared_parameters
from replicator.testing import assert_params_close, run_distributed
from tests.distributed.model_parallel_models import (
    GLOBAL_BATCH,
    TIED_SEQ,
    TIED_VOCAB,
    loss_of,
    make_tied_gpt2,
    merge_ranks,
    token_data,
    train,
)
from tests.helpers import hang

WTE, HEAD = "transformer.wte.weight", "lm_head.weight"
ATOL = 5e-5


def _max_diff(expected: dict, actual: dict) -> float:
    return max(float((expected[k].double() - actual[k].double()).abs().max()) for k in actual)


def _inspect(model: torch.nn.Module) -> dict:
    """The runner's description and its full state dict, saved with ``torch.save`` on the
    first rank of the pipeline (``None`` on the others)."""
    runner = PipelineRunner.of(model)
    assert runner is not None
    full = runner.full_state_dict()
    saved = None
    if full:
        buf = io.BytesIO()
        torch.save(full, buf)
        saved = buf.getvalue()
    return {"describe": runner.describe(), "saved": saved}


def _accumulate(strategy: rp.Strategy, steps: int = 3) -> dict:
    """AdamW steps of two backward passes each (the first under ``no_sync``), so a tied
    weight's gradient accumulates before it is stepped."""
    with strategy.scope():
        model = make_tied_gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, eps=1e-6)

    def step(batch: tuple) -> torch.Tensor:
        x, y = batch
        losses = []
        for i, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
            with strategy.no_sync() if i == 0 else contextlib.nullcontext():
                loss = loss_of(model(xs).logits, ys) / 2
                loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        return sum(losses)

    data = torch.utils.data.DataLoader(token_data(vocab=TIED_VOCAB, seq=TIED_SEQ),
                                       batch_size=GLOBAL_BATCH, shuffle=True)
    it = iter(strategy.distribute_dataset(data, seed=3))
    for _ in range(steps):
        strategy.run(step, args=(next(it),))
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v.numel()}


def _one_device(_: int) -> dict:
    strategy = rp.OneDeviceStrategy("cpu")
    return {"train": train(strategy, "gpt2_tied", "adamw"),
            "accumulate": _accumulate(rp.OneDeviceStrategy("cpu"))}


def _pipelines(_: int) -> dict:
    def pipe(stages: int, schedule: str = "1f1b") -> rp.Strategy:
        return rp.PipelineStrategy(num_stages=stages, num_microbatches=4, schedule=schedule)

    return {"1f1b": train(pipe(2), "gpt2_tied", "adamw", inspect=_inspect),
            "single_pass": train(pipe(2), "gpt2_tied", "adamw", single_pass=True),
            # stage 0 on rank 0, stage 3 on rank 1; zbv puts both on rank 0 (no exchange)
            "interleaved": train(pipe(4, "interleaved_1f1b"), "gpt2_tied", "adamw",
                                 inspect=_inspect),
            "zbv": train(pipe(4, "zbv"), "gpt2_tied", "adamw", inspect=_inspect),
            "accumulate": _accumulate(pipe(2))}


def _data_by_pipeline(_: int) -> dict:
    def mesh() -> rp.Strategy:
        return rp.MeshStrategy(data=2, pipeline=2, pipeline_options={"num_microbatches": 2})

    return {"train": train(mesh(), "gpt2_tied", "adamw", inspect=_inspect),
            "accumulate": _accumulate(mesh())}


def _check_saved(saved: bytes, ref: dict, label: str) -> None:
    """The saved full state dict loads into the one-device model, the tied weight once."""
    loaded = torch.load(io.BytesIO(saved), weights_only=True)
    one = make_tied_gpt2()
    assert list(loaded) == list(one.state_dict()), label
    assert loaded[HEAD].untyped_storage().data_ptr() == \
        loaded[WTE].untyped_storage().data_ptr(), f"{label}: the tied weight is saved twice"
    one.load_state_dict(loaded)  # strict: every name, no placeholder
    assert one.lm_head.weight is one.transformer.wte.weight
    assert_params_close(ref, {k: v for k, v in one.state_dict().items()}, atol=ATOL,
                        label=f"{label} saved: ")


@pytest.mark.timeout(420)
def test_tied_gpt2_under_pipeline_and_data_by_pipeline_equals_one_device():
    """10 AdamW steps of a GPT-2 whose head is tied to its embedding match one device within
    5e-5 under pipeline 2 (1F1B; one schedule run; interleaved 1F1B with the tie across the
    ranks; ZBV with both tied stages on one rank), under data 2 x pipeline 2, and with
    gradient accumulation under both; the two copies stay bit-identical and the full state
    dict saves the tied weight once."""
    pytest.importorskip("transformers")
    ref = run_distributed(_one_device, 1, args=(0,), timeout_seconds=120)[0]
    out = run_distributed(_pipelines, 2, args=(0,), timeout_seconds=200)
    diffs = {}
    for run in ("1f1b", "single_pass", "interleaved", "zbv"):
        merged = merge_ranks([{run: o[run]} for o in out], [0, 1])[run]["state"]
        assert_params_close(ref["train"]["state"], merged, atol=ATOL, label=f"{run}: ")
        diffs[run] = _max_diff(ref["train"]["state"], merged)
        assert out[0][run]["losses"] == pytest.approx(ref["train"]["losses"], abs=1e-5)
    for run in ("1f1b", "single_pass", "interleaved"):  # a copy on each rank, equal
        assert torch.equal(out[0][run]["state"][WTE], out[1][run]["state"][HEAD]), run
        assert torch.equal(out[0][run]["state"][WTE], out[0][run]["state"][HEAD]), run
    assert WTE not in out[1]["zbv"]["state"]  # zbv: both tied stages on rank 0
    assert "tied: transformer.wte.weight = lm_head.weight (stages 0 and 1)" in \
        out[0]["1f1b"]["inspected"]["describe"]
    assert "(stages 0 and 3)" in out[1]["interleaved"]["inspected"]["describe"]
    assert "tied" not in out[0]["zbv"]["inspected"]["describe"]
    for run in ("1f1b", "interleaved", "zbv"):
        assert out[1][run]["inspected"]["saved"] is None
        _check_saved(out[0][run]["inspected"]["saved"], ref["train"]["state"], run)
    merged = {**out[0]["accumulate"], **out[1]["accumulate"]}
    assert_params_close(ref["accumulate"], merged, atol=ATOL, label="accumulate: ")
    diffs["accumulate"] = _max_diff(ref["accumulate"], merged)

    out = run_distributed(_data_by_pipeline, 4, args=(0,), timeout_seconds=200)
    for ranks in ([0, 2], [1, 3]):  # each data replica's pipeline (pipeline outermost)
        merged = merge_ranks([{"t": o["train"]} for o in out], ranks)["t"]["state"]
        assert_params_close(ref["train"]["state"], merged, atol=ATOL, label=f"data {ranks}: ")
        diffs[f"data x pipeline {ranks}"] = _max_diff(ref["train"]["state"], merged)
        acc = {**out[ranks[0]]["accumulate"], **out[ranks[1]]["accumulate"]}
        assert_params_close(ref["accumulate"], acc, atol=ATOL, label=f"accumulate {ranks}: ")
        diffs[f"data x pipeline accumulate {ranks}"] = _max_diff(ref["accumulate"], acc)
    copies = [o["train"]["state"][k] for o in out for k in (WTE, HEAD)]
    assert all(torch.equal(copies[0], c) for c in copies)  # 4 ranks, one value
    for rank in (0, 1):  # the first stage of each pipeline
        _check_saved(out[rank]["train"]["inspected"]["saved"], ref["train"]["state"],
                     f"data x pipeline rank {rank}")
    print("max |parameter difference| to one device:",
          ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))


def test_shared_parameters_are_found_and_allowed():
    pytest.importorskip("transformers")
    model = make_tied_gpt2()
    from replicator.parallel.pipeline_split import known_chain

    known = known_chain(model)
    assert known is not None
    chain = flatten_chain(known[0])
    stages = build_stages(chain, [0, 2])  # no error: tied weights are allowed
    (param, used_by), = shared_parameters(stages)
    assert param is model.lm_head.weight and used_by == [0, 1]
    assert shared_parameters(build_stages(chain, [0])) == []  # one stage: nothing shared


def _tied_language_model() -> torch.nn.Sequential:
    """Embedding, a layer and an output head sharing the embedding's weight (an
    ``nn.Sequential``: the pipeline cuts it before the layer)."""
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False)
    head.weight = embed.weight
    return torch.nn.Sequential(embed, torch.nn.Linear(8, 8), head)


def _tied_sum_hangs(gave_up: str) -> tuple[str, str, float]:
    strategy = rp.PipelineStrategy(num_stages=2, num_microbatches=2, schedule="gpipe",
                                   split_points=["1"])
    with strategy.scope():
        model = _tied_language_model()
    runner = PipelineRunner.of(model)
    assert runner is not None
    if dist.get_rank() == 1:  # rank 1 reaches the tied sum 12 s late, or once rank 0 failed
        original = runner.tied.sum_gradients

        def late(kept: list) -> None:
            hang(12, gave_up)
            original(kept)

        runner.tied.sum_gradients = late  # type: ignore[method-assign]
    x = torch.randint(0, 16, (2, 4))
    start = time.monotonic()
    try:
        model(x).sum().backward()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc), time.monotonic() - start
    finally:
        if dist.get_rank() == 0:
            Path(gave_up).touch()  # the late holder may come now
    return "", "no error", time.monotonic() - start


@pytest.mark.timeout(90)
def test_a_hung_tied_weight_holder_is_named_after_the_timeout(tmp_path):
    """Rank 1 reaches the sum of the tied gradients late (12 s, or once rank 0 has failed);
    rank 0, waiting in it, fails after the 4 s timeout naming the pass, the tied weight and
    rank 1."""
    (kind, text, seconds), _ = run_distributed(_tied_sum_hangs, 2,
                                               args=(str(tmp_path / "gave_up"),),
                                               timeout_seconds=4)
    assert kind == "ReplicaTimeoutError", (kind, text)
    assert "sum of the gradients of tied weights on rank 0 with rank 1" in text, text
    assert "(held here: 0.weight = 2.weight)" in text and "waited 4 s" in text, text
    assert 3 < seconds < 11, seconds


def _checkpoint_session(layout: str, directory: str, save: bool) -> tuple:
    """3 AdamW steps then a sharded save, or a load; the logits of a probe after it and after
    2 more steps (the optimizer state came back too)."""
    from replicator.resume import load_sharded, save_sharded

    strategy = (rp.PipelineStrategy(num_stages=2) if layout == "pipeline"
                else rp.OneDeviceStrategy("cpu"))
    with strategy.scope():
        model = make_tied_gpt2(seed=2 if save else 7)  # loading must overwrite the init
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)

    def steps(n: int, seed: int) -> None:
        def step(batch: tuple) -> None:
            loss_of(model(batch[0]).logits, batch[1]).backward()
            optimizer.step()
            optimizer.zero_grad()

        data = torch.utils.data.DataLoader(token_data(vocab=TIED_VOCAB, seq=TIED_SEQ),
                                           batch_size=GLOBAL_BATCH, shuffle=True)
        it = iter(strategy.distribute_dataset(data, seed=seed))
        for _ in range(n):
            strategy.run(step, args=(next(it),))

    if save:
        steps(3, seed=1)
        save_sharded(directory, 3, model, optimizer)
    else:
        load_sharded(directory, model, optimizer)
    probe = torch.arange(4 * TIED_SEQ).reshape(4, TIED_SEQ) % TIED_VOCAB
    with torch.no_grad():
        before = model(probe).logits.clone()
    steps(2, seed=2)
    with torch.no_grad():
        after = model(probe).logits.clone()
    return before, after


@pytest.mark.timeout(240)
def test_tied_gpt2_sharded_checkpoint_from_a_pipeline_loads_into_one_device(tmp_path):
    """A sharded checkpoint saved under pipeline 2 (the tied weight held by both ranks)
    loads into one device and into pipeline 2, optimizer state included."""
    pytest.importorskip("transformers")
    saved = run_distributed(_checkpoint_session, 2, args=("pipeline", str(tmp_path), True),
                            timeout_seconds=120)[0]
    one = run_distributed(_checkpoint_session, 1, args=("one", str(tmp_path), False),
                          timeout_seconds=120)[0]
    pipe = run_distributed(_checkpoint_session, 2, args=("pipeline", str(tmp_path), False),
                           timeout_seconds=120)[0]
    for loaded in (one, pipe):
        torch.testing.assert_close(loaded[0], saved[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(loaded[1], saved[1], atol=1e-5, rtol=0)

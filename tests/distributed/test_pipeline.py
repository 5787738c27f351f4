"""PipelineStrategy (torch.distributed.pipelining) on 2 real gloo processes equals one device;
splitting rules and errors."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import replicator as rp
from replicator.parallel.pipeline_split import (
    PipelineSplitError,
    balanced_starts,
    check_stage_count,
    flatten_chain,
    named_starts,
)
from replicator.testing import assert_params_close, run_distributed
from tests.distributed.model_parallel_models import (
    make_transformer,
    merge_ranks,
    one_device,
    train,
    train_all,
)
from tests.helpers import hang

CONFIGS = (("mlp", "sgd"), ("mlp", "adam"), ("transformer", "sgd"), ("transformer", "adam"))
RUNS = (("gpipe", 4, CONFIGS), ("gpipe", 8, CONFIGS), ("1f1b", 4, CONFIGS),
        ("1f1b", 8, CONFIGS),
        # two stages per rank: 4 stages on 2 ranks
        ("interleaved_1f1b", 4, (("transformer", "adam"),)),
        ("zero_bubble", 4, (("transformer", "adam"),)))


def _pipelines(runs: tuple) -> dict:
    out = {}
    for schedule, microbatches, configs in runs:
        stages = 2 if schedule in ("gpipe", "1f1b") else 4
        strategy = rp.PipelineStrategy(num_stages=stages, num_microbatches=microbatches,
                                       schedule=schedule)
        out[f"{schedule}_m{microbatches}"] = train_all(strategy, configs)
    return out


def _check(ref: dict, out: list[dict]) -> None:
    for run in out[0]:
        merged = merge_ranks([o[run] for o in out], [0, 1])
        for key in out[0][run]:
            assert_params_close(ref[key]["state"], merged[key]["state"], atol=1e-5,
                                label=f"{run} {key}: ")
            for rank in (0, 1):  # the loss is reported on every rank, not only the last stage
                assert out[rank][run][key]["losses"] == pytest.approx(ref[key]["losses"],
                                                                       abs=1e-5)
        # each rank holds its own stage only
        key = next(iter(out[0][run]))
        assert not set(out[0][run][key]["state"]) & set(out[1][run][key]["state"])


@pytest.mark.timeout(360)
def test_gpipe_1f1b_interleaved_and_zero_bubble_equal_one_device():
    """Gradients are neither divided twice nor left summed over microbatches: 10 SGD and 10
    Adam steps of GPipe and 1F1B with 4 and 8 microbatches match one device on an MLP and on
    a transformer; interleaved 1F1B and zero bubble on the transformer with Adam."""
    ref = run_distributed(one_device, 1, args=(CONFIGS,), timeout_seconds=120)[0]
    out = run_distributed(_pipelines, 2, args=(RUNS,), timeout_seconds=340)
    _check(ref, out)
    gpipe = out[0]["gpipe_m8"]["transformer_adam"]["memory"]["peak_activation_bytes"]
    one_f_one_b = out[0]["1f1b_m8"]["transformer_adam"]["memory"]["peak_activation_bytes"]
    assert 0 < one_f_one_b < 0.6 * gpipe  # 1F1B keeps fewer microbatches in flight


def _single_pass(_: int) -> dict:
    out = {}
    for schedule, microbatches in (("gpipe", 4), ("1f1b", 8)):
        strategy = rp.PipelineStrategy(num_stages=2, num_microbatches=microbatches,
                                       schedule=schedule)
        out[f"{schedule}_m{microbatches}"] = {
            f"{m}_{o}": train(strategy, m, o, single_pass=True)
            for m, o in (("mlp", "sgd"), ("transformer", "adam"))}
    # a model the strategy does not pipeline: the plain forward and backward
    plain = torch.nn.Linear(2, 2, bias=False)
    torch.nn.init.ones_(plain.weight)
    loss = strategy.forward_backward(plain, torch.ones(8, 2), torch.zeros(8, 2),
                                     torch.nn.functional.mse_loss)
    out["plain"] = [loss.item(), plain.weight.grad.tolist()]
    # and under a data-parallel strategy, the same call
    one = rp.OneDeviceStrategy("cpu")
    with one.scope():
        again = torch.nn.Linear(2, 2, bias=False)
    torch.nn.init.ones_(again.weight)
    loss = one.forward_backward(again, torch.ones(8, 2), torch.zeros(8, 2),
                                torch.nn.functional.mse_loss)
    out["one_device"] = [loss.item(), again.weight.grad.tolist()]
    return out


@pytest.mark.timeout(240)
def test_forward_backward_in_one_schedule_run_equals_one_device():
    """``strategy.forward_backward(model, x, y, loss_fn)`` runs forward and backward in one
    schedule run (no second forward pass): 10 SGD and 10 Adam steps equal one device and the
    returned loss is the batch's, on both ranks; a model that is not pipelined, and every
    other strategy, run the plain forward and backward."""
    configs = (("mlp", "sgd"), ("transformer", "adam"))
    ref = run_distributed(one_device, 1, args=(configs,), timeout_seconds=120)[0]
    out = run_distributed(_single_pass, 2, args=(0,), timeout_seconds=220)
    plain = [(o.pop("plain"), o.pop("one_device")) for o in out]
    _check(ref, out)
    # each output is 2: loss 2 ** 2 = 4; dL/dW = 8 rows x 2 x 2 x 1 / 16 outputs = 2
    assert all(p == o == [4.0, [[2.0, 2.0], [2.0, 2.0]]] for p, o in plain), plain


class Noise(torch.nn.Module):
    """Adds random noise (like dropout, it draws from the RNG) and remembers each draw."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand_like(x)
        self.draws.append(noise)
        return x + noise


def _random_layers_see_the_same_draws(_: int) -> list:
    strategy = rp.PipelineStrategy(num_stages=2, num_microbatches=2, schedule="1f1b")
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), Noise(), torch.nn.Linear(4, 4),
                                    Noise())
    model(torch.randn(4, 4)).sum().backward()
    local = [m for m in model if isinstance(m, Noise) and m.draws]
    return [[d.tolist() for d in m.draws] for m in local]


def _split_options(_: int) -> dict:
    named = rp.PipelineStrategy(num_stages=2, num_microbatches=2, split_points=["2"])
    a = train(named, "transformer", "sgd", steps=2)
    timed = rp.PipelineStrategy(num_stages=2, num_microbatches=2, balance="time")
    b = train(timed, "transformer", "sgd", steps=2)
    bad = rp.PipelineStrategy(num_stages=2, num_microbatches=3)
    with bad.scope():
        model = make_transformer()
    try:
        model(torch.zeros(16, 8, dtype=torch.long))
        error = ""
    except ValueError as exc:
        error = str(exc)
    return {"named": sorted(a["state"]), "timed": sorted(b["state"]), "error": error,
            "draws": _random_layers_see_the_same_draws(0)}


@pytest.mark.timeout(120)
def test_split_points_time_balance_microbatch_error_and_replayed_randomness():
    out = run_distributed(_split_options, 2, args=(0,), timeout_seconds=100)
    assert {k.split(".")[0] for k in out[0]["named"]} == {"0", "1"}
    assert {k.split(".")[0] for k in out[1]["named"]} == {"2", "3"}
    held = {k.split(".")[0] for k in out[0]["timed"]} | {k.split(".")[0] for k in
                                                          out[1]["timed"]}
    assert held == {"0", "1", "2", "3"} and out[0]["timed"] and out[1]["timed"]
    assert "16 rows does not divide into 3 microbatches" in out[0]["error"]
    for rank in (0, 1):  # the value pass and the schedule draw the same random numbers
        (draws,) = out[rank]["draws"]
        assert len(draws) == 4 and draws[:2] == draws[2:]


def test_chain_is_flattened_and_balanced_by_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4),
                                torch.nn.Sequential(torch.nn.Linear(4, 40), torch.nn.ReLU(),
                                                    torch.nn.Linear(40, 4)),
                                torch.nn.Linear(4, 2))
    names = [n for n, _ in flatten_chain(model)]
    assert names == ["0", "1.0", "1.1", "1.2", "2"]
    assert balanced_starts([20, 200, 1, 164, 10], 2) == [0, 2]
    assert balanced_starts([1, 1, 1, 1], 4) == [0, 1, 2, 3]
    assert named_starts(flatten_chain(model), ["1.2"], 2) == [0, 3]


def test_split_errors_are_clear():
    class NotAChain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    with pytest.raises(PipelineSplitError, match="cannot cut a NotAChain.*layers.*nn.Sequential"):
        flatten_chain(NotAChain())
    chain = flatten_chain(make_transformer())
    with pytest.raises(PipelineSplitError, match="5 stages but the model has only 4 block"):
        check_stage_count(chain, 5)
    with pytest.raises(PipelineSplitError, match="split point '7' is not a block"):
        named_starts(chain, ["7"], 2)
    with pytest.raises(PipelineSplitError, match="2 stages need 1 split point"):
        named_starts(chain, ["1", "2"], 2)
    with pytest.raises(ValueError, match="at least as many microbatches as pipeline ranks"):
        rp.PipelineStrategy(num_stages=4, num_microbatches=2, schedule="1f1b")
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        rp.PipelineStrategy(schedule="pipedream")


def _trainer_verbose_2(_: int) -> dict:
    import contextlib
    import io

    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from tests.distributed.model_parallel_models import make_mlp, mlp_data

    strategy = rp.PipelineStrategy(num_stages=2, num_microbatches=4)
    trainer = rp.Trainer(strategy, make_mlp, lambda p: torch.optim.SGD(p, lr=0.1),
                         F.cross_entropy)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        history = trainer.fit(DataLoader(mlp_data(), batch_size=16), epochs=1,
                              steps_per_epoch=3, verbose=2)
    return {"out": text.getvalue(), "loss": history.history["loss"]}


@pytest.mark.timeout(120)
def test_trainer_runs_a_pipeline_and_prints_memory_per_rank_at_verbose_2():
    out = run_distributed(_trainer_verbose_2, 2, args=(0,), timeout_seconds=100)
    assert "memory per rank" in out[0]["out"] and "rank 1: parameters" in out[0]["out"]
    assert "memory per rank" not in out[1]["out"]
    assert out[0]["loss"] == out[1]["loss"] and out[0]["loss"][0] > 0


def _gpt2(kind: str) -> dict:
    strategy = (rp.PipelineStrategy(num_stages=2, num_microbatches=4) if kind == "pipeline"
                else rp.FSDPStrategy())
    return train_all(strategy, (("gpt2", "adam"),))


@pytest.mark.timeout(240)
def test_hugging_face_gpt2_under_pipeline_and_fsdp_equals_one_device():
    pytest.importorskip("transformers")
    ref = run_distributed(one_device, 1, args=((("gpt2", "adam"),),), timeout_seconds=120)[0]
    pipeline = run_distributed(_gpt2, 2, args=("pipeline",), timeout_seconds=200)
    merged = merge_ranks(pipeline, [0, 1])
    assert_params_close(ref["gpt2_adam"]["state"], merged["gpt2_adam"]["state"], atol=5e-5)
    held0 = {k.split(".")[2] for k in pipeline[0]["gpt2_adam"]["state"] if ".h." in k}
    held1 = {k.split(".")[2] for k in pipeline[1]["gpt2_adam"]["state"] if ".h." in k}
    assert held0 and held1 and not held0 & held1  # split over its blocks
    fsdp = run_distributed(_gpt2, 2, args=("fsdp",), timeout_seconds=200)
    assert_params_close(ref["gpt2_adam"]["state"], fsdp[0]["gpt2_adam"]["state"], atol=5e-5)


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float,  # type: ignore[override]
                until: str) -> torch.Tensor:
        ctx.seconds, ctx.until = seconds, until
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        hang(ctx.seconds, ctx.until)
        return grad, None, None


class HungOnRank(torch.nn.Module):
    """Identity whose first backward on global rank ``rank`` hangs for ``seconds``, or until
    the file ``until`` exists (a stage whose peer sees it hang; see ``tests.helpers.hang``)."""

    def __init__(self, rank: int, seconds: float, until: str) -> None:
        super().__init__()
        self.rank, self.seconds, self.until, self.slept = rank, seconds, until, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() != self.rank or self.slept or not torch.is_grad_enabled():
            return x
        self.slept = True
        return _SleepInBackward.apply(x, self.seconds, self.until)


def _stage_hangs(gave_up: str) -> tuple[str, str, float]:
    strategy = rp.PipelineStrategy(num_stages=2, num_microbatches=2, schedule="gpipe",
                                   split_points=["1"])
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4),
                                    HungOnRank(rank=1, seconds=12, until=gave_up))
    start = time.monotonic()
    try:
        model(torch.randn(4, 4)).sum().backward()  # the schedule's step runs in backward
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc), time.monotonic() - start
    finally:
        if dist.get_rank() == 0:
            Path(gave_up).touch()  # the hung stage may stop hanging now
    return "", "no error", time.monotonic() - start


@pytest.mark.timeout(90)
def test_a_hung_stage_fails_its_peer_after_the_timeout_naming_the_ranks(tmp_path):
    """Stage 1 (rank 1) hangs in backward (12 s, or until rank 0 has failed); rank 0, waiting
    in the schedule's step for its gradients, fails after the 4 s timeout instead of hanging,
    naming both ranks and the pass it was in."""
    (kind, text, seconds), _ = run_distributed(_stage_hangs, 2, args=(str(tmp_path / "gave_up"),),
                                               timeout_seconds=4)
    assert kind == "ReplicaTimeoutError", (kind, text)
    assert "on rank 0" in text and "exchanging with rank 1" in text, text
    assert "gpipe schedule step (backward" in text and "waited 4 s" in text, text
    assert 3 < seconds < 11, seconds

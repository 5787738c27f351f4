"""FSDPStrategy (FSDP2 fully_shard) on 2 real gloo processes equals one device."""

from __future__ import annotations

import pytest
import torch

import replicator as rp
from replicator.strategies.memory import optimizer_state_bytes
from replicator.testing import assert_params_close, run_distributed
from tests.distributed.model_parallel_models import make_transformer, one_device, train, train_all

CONFIGS = (("mlp", "sgd"), ("mlp", "adam"), ("transformer", "sgd"), ("transformer", "adam"))


def _fsdp(configs: tuple, zero_stage: int) -> dict:
    out = train_all(rp.FSDPStrategy(zero_stage=zero_stage), configs)
    # ZeRO-2 (parameters kept gathered from forward to backward) on one config
    out["zero2_transformer_adam"] = train(rp.FSDPStrategy(zero_stage=2), "transformer", "adam")
    return out


@pytest.mark.timeout(240)
def test_fsdp_zero3_and_zero2_equal_one_device_mlp_and_transformer_sgd_and_adam():
    ref = run_distributed(one_device, 1, args=(CONFIGS,), timeout_seconds=120)[0]
    out = run_distributed(_fsdp, 2, args=(CONFIGS, 3), timeout_seconds=180)
    assert_params_close(ref["transformer_adam"]["state"],
                        out[1]["zero2_transformer_adam"]["state"], atol=1e-5, label="zero2")
    for key in ref:
        assert_params_close(ref[key]["state"], out[0][key]["state"], atol=1e-5, label=key)
        assert out[0][key]["losses"] == pytest.approx(ref[key]["losses"], abs=1e-5)
        assert out[0][key]["losses"] == out[1][key]["losses"]
    assert ref["mlp_sgd"]["losses"][0] != ref["mlp_sgd"]["losses"][-1]  # it trained
    for key in ref:  # every parameter with more than one element is sharded
        assert len(out[0][key]["sharded"]) == sum(v.numel() > 1 for v in
                                                  ref[key]["state"].values())


def _fsdp_optimizer_state_bytes(_: int) -> int:
    strategy = rp.FSDPStrategy()
    return train(strategy, "transformer", "adam", steps=2)["memory"]["optimizer_state_bytes"]


def _replicated_optimizer_state_bytes() -> int:
    """What every Mirrored replica holds: the whole optimizer state, as on one device."""
    model = make_transformer()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
        optimizer.step()
    return optimizer_state_bytes([optimizer])


@pytest.mark.timeout(120)
def test_fsdp_optimizer_state_per_rank_is_half_of_replicated():
    fsdp = run_distributed(_fsdp_optimizer_state_bytes, 2, args=(0,), timeout_seconds=90)
    full = _replicated_optimizer_state_bytes()
    for rank in (0, 1):
        assert fsdp[rank] == pytest.approx(full / 2, rel=0.10)


def test_zero_stage_1_is_refused_with_a_hint():
    with pytest.raises(ValueError, match="zero_stage must be 2 or 3"):
        rp.FSDPStrategy(zero_stage=1)
    with pytest.raises(ValueError, match="contradicts"):
        rp.FSDPStrategy(reshard_after_forward=False, zero_stage=3)


def _reduce_and_gather_paths(_: int) -> dict:
    strategy = rp.FSDPStrategy()
    rank = strategy.replica_id
    out = {"shared_memory": strategy.collectives.uses_shared_memory,
           "mean": float(strategy.reduce("mean", torch.tensor(float(rank + 1)))),
           "sum": strategy.reduce("sum", torch.tensor([rank, 10.0 * rank])).tolist(),
           "gather": strategy.gather(torch.full((rank + 1,), float(rank))).tolist()}
    strategy.close()
    return out


@pytest.mark.timeout(120)
def test_fsdp_reduces_and_gathers_through_shared_memory_on_one_cpu_host():
    """The data axes' own collectives (reduce, gather, fingerprints) take the same-host path
    MirroredStrategy takes, not a gloo round trip per scalar; the values are the same."""
    out = run_distributed(_reduce_and_gather_paths, 2, args=(0,), timeout_seconds=90)
    for rank in (0, 1):
        assert out[rank]["shared_memory"] is True
        assert out[rank]["mean"] == pytest.approx(1.5)
        assert out[rank]["sum"] == [1.0, 10.0]
        assert out[rank]["gather"] == [0.0, 1.0, 1.0]

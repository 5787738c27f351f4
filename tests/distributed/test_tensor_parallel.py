"""TensorParallelStrategy (DTensor parallelize_module) on 2 real gloo processes equals one
device; plan errors name close modules."""

from __future__ import annotations

import pytest
import torch

import replicator as rp
from replicator.parallel.tensor_parallel import TensorPlanError, check_plan, default_plan
from replicator.testing import assert_params_close, run_distributed
from tests.distributed.model_parallel_models import (
    DIM,
    GLOBAL_BATCH,
    SEQ,
    make_mlp,
    make_transformer,
    one_device,
    train_all,
)

CONFIGS = (("mlp", "sgd"), ("mlp", "adam"), ("transformer", "sgd"), ("transformer", "adam"))


def _tensor_parallel(configs: tuple) -> dict:
    strategy = rp.TensorParallelStrategy()
    assert strategy.num_replicas_in_sync == 1
    return train_all(strategy, configs)


@pytest.mark.timeout(240)
def test_tensor_parallel_equals_one_device_mlp_and_transformer_sgd_and_adam():
    ref = run_distributed(one_device, 1, args=(CONFIGS,), timeout_seconds=120)[0]
    out = run_distributed(_tensor_parallel, 2, args=(CONFIGS,), timeout_seconds=180)
    for key in ref:
        assert_params_close(ref[key]["state"], out[0][key]["state"], atol=1e-5, label=key)
        assert out[1][key]["losses"] == pytest.approx(ref[key]["losses"], abs=1e-5)
    sharded = out[0]["transformer_adam"]["sharded"]  # attention, MLP, embeddings split
    assert "1.attn.q.weight" in sharded and "1.mlp.fc2.weight" in sharded
    assert "0.tok.weight" in sharded and "3.out.weight" not in sharded


def test_default_plan_pairs_mlp_layers_and_splits_attention_by_heads():
    mlp = default_plan(make_mlp(), 2)
    assert mlp == {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}
    plan = default_plan(make_transformer(), 2)
    assert plan["1.attn.q"] == plan["1.attn.k"] == plan["1.attn.v"] == "colwise"
    assert plan["1.attn.o"] == "rowwise"
    assert plan["2.mlp.fc1"] == "colwise" and plan["2.mlp.fc2"] == "rowwise"
    assert plan["0.tok"] == "embedding"
    assert "3.out" not in plan  # the head stays replicated
    assert default_plan(torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2)),
                        2) == {}  # 5 features do not split in 2


def test_plan_naming_a_missing_module_lists_close_names():
    with pytest.raises(TensorPlanError, match=r"'1\.attn\.qq'.*Close names: 1\.attn\.q"):
        check_plan(make_transformer(), {"1.attn.qq": "colwise"})
    with pytest.raises(TensorPlanError, match="style 'diagonal'"):
        check_plan(make_transformer(), {"1.attn.q": "diagonal"})
    assert len(check_plan(make_transformer(), {"*.mlp.fc1": "colwise"})) == 1


SP_CONFIGS = (("transformer", "sgd"), ("transformer", "adam"))


def _sequence_parallel(sequence_parallel: bool) -> dict:
    return train_all(rp.TensorParallelStrategy(sequence_parallel=sequence_parallel), SP_CONFIGS)


@pytest.mark.timeout(240)
def test_sequence_parallel_norms_equal_one_device_and_shard_activations():
    ref = run_distributed(one_device, 1, args=(SP_CONFIGS,), timeout_seconds=120)[0]
    sp = run_distributed(_sequence_parallel, 2, args=(True,), timeout_seconds=180)
    tp = run_distributed(_sequence_parallel, 2, args=(False,), timeout_seconds=180)
    for key in ref:
        for rank in (0, 1):
            assert_params_close(ref[key]["state"], sp[rank][key]["state"], atol=1e-5,
                                label=f"{key} rank {rank}")
            assert sp[rank][key]["losses"] == pytest.approx(ref[key]["losses"], abs=1e-5)
    # each block's two norms save half of their float32 input (the other half of the sequence
    # is on the other rank); attention and the MLP still see the whole sequence
    peak_sp = sp[0]["transformer_sgd"]["memory"]["peak_activation_bytes"]
    peak_tp = tp[0]["transformer_sgd"]["memory"]["peak_activation_bytes"]
    halved_norm_inputs = 2 * 2 * (GLOBAL_BATCH * SEQ * DIM * 4) // 2
    assert peak_tp - peak_sp >= halved_norm_inputs, (peak_sp, peak_tp)


def test_sequence_parallel_plan_shards_the_blocks_norms_only():
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    from replicator.parallel.tensor_parallel import sequence_parallel_plan

    model = make_transformer()
    plan = sequence_parallel_plan(model, default_plan(model, 2))
    for block in ("1", "2"):
        assert isinstance(plan[block], PrepareModuleInputOutput)
        assert isinstance(plan[f"{block}.ln1"], SequenceParallel)
        assert isinstance(plan[f"{block}.ln2"], SequenceParallel)
        assert isinstance(plan[f"{block}.attn"], PrepareModuleInput)
        assert isinstance(plan[f"{block}.mlp.fc2"], RowwiseParallel)
        assert plan[f"{block}.attn.q"] == "colwise"
    assert "3.ln" not in plan and "3" not in plan  # the head's norm feeds a replicated layer
    assert "0" not in plan  # the embedding adds positions over the whole sequence
    assert sequence_parallel_plan(make_mlp(), default_plan(make_mlp(), 2)) == \
        default_plan(make_mlp(), 2)


def _odd_sequence() -> str:
    strategy = rp.TensorParallelStrategy(sequence_parallel=True)
    with strategy.scope():
        model = make_transformer()
    try:
        model(torch.zeros(2, SEQ - 1, dtype=torch.long))
    except ValueError as exc:
        return str(exc)
    return ""


@pytest.mark.timeout(120)
def test_sequence_parallel_refuses_a_sequence_that_does_not_split():
    message = run_distributed(_odd_sequence, 2, timeout_seconds=60)[0]
    assert "sequence-parallel block '1'" in message and "divide by the tensor-parallel" in message

"""MeshStrategy compositions on 4 real gloo processes equal one device; degree errors."""

from __future__ import annotations

import pytest

import replicator as rp
from replicator.errors import ClusterConfigError
from replicator.testing import assert_params_close, run_distributed
from tests.distributed.model_parallel_models import merge_ranks, one_device, train_all

CONFIGS = (("mlp", "sgd"), ("mlp", "adam"), ("transformer", "sgd"), ("transformer", "adam"))
MESHES = ({"data": 2, "pipeline": 2}, {"data": 2, "tensor": 2}, {"fsdp": 2, "tensor": 2},
          {"data": 2, "fsdp": 2})  # the last: hybrid sharding, on one config only


def _meshes(configs: tuple) -> dict:
    out: dict = {}
    try:
        rp.MeshStrategy(data=2, tensor=4)
    except ClusterConfigError as exc:
        out["bad_degrees"] = str(exc)
    for degrees in MESHES:
        strategy = rp.MeshStrategy(**degrees)
        name = "x".join(f"{a}{n}" for a, n in degrees.items())
        few = configs if "pipeline" in degrees or "tensor" in degrees else configs[-1:]
        out[name] = {"result": train_all(strategy, few),
                     "replicas": strategy.num_replicas_in_sync,
                     "replica_id": strategy.replica_id,
                     "coordinate": strategy.topology.coordinate,
                     "chief": strategy.is_chief}
    return out


@pytest.mark.timeout(400)
def test_data_pipeline_data_tensor_fsdp_tensor_and_data_fsdp_equal_one_device():
    """Also: degrees whose product is not the world size are a clear error."""
    ref = run_distributed(one_device, 1, args=(CONFIGS,), timeout_seconds=120)[0]
    out = run_distributed(_meshes, 4, args=(CONFIGS,), timeout_seconds=380)
    assert "make 8 processes, but the job has 4" in out[0].pop("bad_degrees")
    assert "-1" in out[1].pop("bad_degrees")  # the hint offers inferring one axis
    for name in out[0]:
        info = [o[name] for o in out]
        replicas = 4 if name == "data2xfsdp2" else 2
        assert [i["replicas"] for i in info] == [replicas] * 4
        assert [i["chief"] for i in info] == [True, False, False, False]
        if "pipeline" in name:  # replica 0 = stage 0 on rank 0 and stage 1 on rank 2
            assert [i["coordinate"]["pipeline"] for i in info] == [0, 0, 1, 1]
            results = merge_ranks([i["result"] for i in info], [0, 2])
        else:
            results = info[0]["result"]
        for key in results:
            assert_params_close(ref[key]["state"], results[key]["state"], atol=1e-5,
                                label=f"{name} {key}: ")
            for i in info:
                assert i["result"][key]["losses"] == pytest.approx(ref[key]["losses"],
                                                                   abs=1e-5)
        # ranks of one replica got the same batch; the two replicas different halves
        expected = [0, 1, 2, 3] if replicas == 4 else [0, 0, 1, 1]
        assert sorted(i["replica_id"] for i in info) == expected

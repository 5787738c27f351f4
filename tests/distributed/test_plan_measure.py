"""The machine figures ``replicator plan`` measures with several processes, on real ranks."""

import math

import pytest
import torch

import replicator as rp
from replicator.plan import measure


def _engine_figures(reference_alone: float) -> tuple[float, float, float]:
    torch.set_num_threads(1)
    t_local = measure._local_backward_seconds()
    return measure._engine_overheads(t_local, reference_alone, slowdown=1.0)


@pytest.mark.timeout(120)
def test_the_wait_for_the_slowest_rank_is_taken_on_a_real_training_loop():
    threads = torch.get_num_threads()
    alone = measure._reference_step_seconds()
    assert torch.get_num_threads() == threads  # measured on one thread, then restored
    assert 0 < alone < 0.5
    results = rp.launch(_engine_figures, num_replicas=2, args=(alone,), timeout_seconds=90)
    assert len(results) == 2
    for sync, reduce, wait in results:
        # a reduce and a gradient sync cost something; the wait is never negative
        assert all(math.isfinite(v) for v in (sync, reduce, wait))
        assert reduce > 0 and sync >= 0 and wait >= 0
        assert reduce < 0.5 and wait < 1.0


def _without_reference() -> float:
    return measure._engine_overheads(measure._local_backward_seconds(), 0.0)[2]


@pytest.mark.timeout(120)
def test_without_the_reference_step_no_wait_is_claimed():
    assert rp.launch(_without_reference, num_replicas=2, timeout_seconds=90) == [0.0, 0.0]


@pytest.mark.timeout(120)
def test_a_parameter_servers_round_trip_grows_with_the_gradients_bytes():
    """Two workers and a real server: the calibration's round trip costs more per byte at
    8 MB than nothing (a fit that had found no cost per byte predicted a 4 MB model's round
    trip at a quarter of what it took)."""
    from replicator.plan.profiles import AlphaBeta

    for _attempt in range(2):
        results = rp.launch(measure._ps_worker, num_replicas=3, num_ps=1, timeout_seconds=90)
        points = results[0]["ps"]
        assert [p[0] for p in points] == [float(n * 4) for n in measure.PS_SIZES]
        assert all(math.isfinite(p[1]) and p[1] >= 0 for p in points)
        assert points[-1][1] > points[0][1]  # (2x quiet; a busy neighbour inflates the small one)
        fit = AlphaBeta.fit([p[0] for p in points], [p[1] for p in points])
        # the cost per byte is the point here; the fixed cost once fitted at 0 with another
        # test running beside this one (b 9.5e-10 s/B, twice a quiet run's), and a busy
        # neighbour once slowed a middle point past a larger one so that the fit found no cost
        # per byte (2 of 5 full runs, 0 of 3 alone; the fit now caps such a point, see
        # test_plan_cost_model): a second measurement for what it cannot tell, not a looser bound
        if fit.b > 0:
            break
    assert fit.b > 0

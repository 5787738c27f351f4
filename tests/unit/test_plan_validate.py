"""The pieces of ``plan --validate`` that keep one noisy moment from deciding a figure."""

import pytest

from replicator.plan.planner import plan_model
from replicator.plan.profiles import MachineProfile, ModelProfile
from replicator.plan.validate import MAX_MEASURED_STEPS, steps_to_measure


def _profile(step: float, fit: tuple[float, float]) -> ModelProfile:
    return ModelProfile(name="m", params=1000, global_batch=64, param_bytes=4000,
                        grad_bytes=4000, step_seconds=step, compute_seconds=step * 0.8,
                        optimizer_seconds=step * 0.1, input_seconds=step * 0.1,
                        compute_fit=fit, collectives_per_step=1.0)


def test_median_profile_takes_each_time_from_the_middle_profile():
    slow, fast, usual = _profile(3e-3, (1e-4, 2e-5)), _profile(1e-3, (3e-4, 1e-5)), \
        _profile(1.5e-3, (2e-4, 4e-5))
    median = ModelProfile.median_of([slow, fast, usual])
    assert median.step_seconds == 1.5e-3 and median.compute_seconds == pytest.approx(1.2e-3)
    assert median.compute_fit == (2e-4, 2e-5)  # each term's own median
    assert median.params == 1000 and median.name == "m"
    assert ModelProfile.median_of([slow]) is slow
    with pytest.raises(ValueError, match="at least one"):
        ModelProfile.median_of([])


def test_a_short_step_is_measured_for_a_second():
    machine = MachineProfile.nominal()
    plan = plan_model(_profile(2e-3, (1e-4, 2e-5)), [1], machine=machine,
                      strategies=("one_device",))
    (p,) = plan.predictions
    assert steps_to_measure(p, 12) == pytest.approx(1.0 / p.step_seconds, abs=1)
    assert steps_to_measure(p, 5000) == 5000  # never fewer than asked
    p.step_seconds = 1e-6
    assert steps_to_measure(p, 12) == MAX_MEASURED_STEPS
    p.step_seconds = 0.5
    assert steps_to_measure(p, 12) == 12


def test_median_machine_takes_each_figure_from_the_middle():
    from replicator.plan.profiles import AlphaBeta

    base = MachineProfile.nominal()
    busy = MachineProfile.from_json({**base.to_json(), "slowdown": {1: 1.0, 2: 1.3},
                                     "ps_round_trip": [2e-3, 3e-9]})
    quiet = MachineProfile.from_json({**base.to_json(), "slowdown": {1: 1.0, 2: 1.0},
                                      "ps_round_trip": [5e-4, 1e-9]})
    usual = MachineProfile.from_json({**base.to_json(), "slowdown": {1: 1.0, 2: 1.1},
                                      "ps_round_trip": [1e-3, 4e-9]})
    median = MachineProfile.median_of([busy, quiet, usual])
    assert median.slowdown == {1: 1.0, 2: 1.1}
    assert median.ps_round_trip == AlphaBeta(1e-3, 3e-9)  # a and b each their own median
    assert median.allreduce == base.allreduce and median.cores == base.cores
    assert MachineProfile.median_of([busy]) is busy


def test_validating_a_gpu_plan_says_only_cpu_plans_are_measured():
    from replicator.plan.validate import validate

    profile = ModelProfile.from_parameter_count(1e6, global_batch=64)
    plan = plan_model(profile, [1, 2], device="h100",
                      machine=MachineProfile.nominal(), strategies=("one_device", "mirrored"))
    with pytest.raises(ValueError, match="a plan for h100 is predicted from nominal figures, "
                                         "and --validate measures CPU plans only"):
        validate(plan, lambda strategy: None)

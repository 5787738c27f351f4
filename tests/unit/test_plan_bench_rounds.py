"""``bench``'s rounds and one-process baseline, on made-up results (no process is started)."""

import pytest

from replicator.plan.settings import (
    Setting,
    SettingResult,
    baseline,
    combine_rounds,
    parse_settings,
    reliability_notes,
)


def _result(setting, step, ok=True):
    return SettingResult(setting, ok, steps=10, steps_asked=10, step_seconds=step,
                         samples_per_second=64 / step if ok else 0.0)


def test_one_process_is_measured_at_its_default_threads_and_at_one_thread():
    settings, _ = parse_settings("one_device,mirrored", "1,2", default_threads=2)
    assert [s.label for s in settings] == ["one_device x1", "one_device x1 (1 thread)",
                                           "mirrored x2"]
    assert len({s.slug for s in settings}) == 3  # each its own log folder
    settings, _ = parse_settings("one_device", "1", default_threads=1)
    assert [s.label for s in settings] == ["one_device x1"]  # one thread already


def test_the_baseline_is_the_faster_one_process_run():
    default, one = Setting("one_device", 1), Setting("one_device", 1, threads=1)
    # a busy machine made the default threads slow (173 ms) where one thread ran at 6 ms
    results = [_result(default, 0.173), _result(one, 0.0063), _result(Setting("mirrored", 2),
                                                                         0.018)]
    assert baseline(results).setting == one
    results[1] = _result(one, 0.2)
    assert baseline(results).setting == default
    assert baseline([_result(Setting("mirrored", 2), 0.01)]) is None
    assert baseline([_result(default, 0.1, ok=False)]) is None


def test_a_setting_is_its_median_round_and_keeps_every_round():
    s = Setting("mirrored", 2)
    combined = combine_rounds([_result(s, 0.062), _result(s, 0.173), _result(s, 0.070)])
    assert combined.step_seconds == pytest.approx(0.070)
    assert combined.rounds == [0.062, 0.173, 0.070]
    assert combined.samples_per_second == pytest.approx(64 / 0.070)
    assert combined.steps == 30 and combined.steps_asked == 30
    assert combined.spread == pytest.approx((0.173 - 0.062) / 0.070)
    # a failed round is left out; every round failed: the setting failed
    assert combine_rounds([_result(s, 0.05, ok=False), _result(s, 0.06)]).ok
    assert not combine_rounds([_result(s, 0.05, ok=False)]).ok


def test_rounds_far_apart_or_a_load_above_the_cores_are_called_unreliable():
    s = Setting("one_device", 1)
    steady = combine_rounds([_result(s, 0.100), _result(s, 0.105), _result(s, 0.098)])
    jumpy = combine_rounds([_result(s, 0.062), _result(s, 0.173), _result(s, 0.070)])
    assert reliability_notes([steady], (1.0, 1.2), cores=2) == []
    (note,) = reliability_notes([jumpy], (1.0, 1.2), cores=2)
    assert "unreliable" in note and "one_device x1 159%" in note
    (note,) = reliability_notes([steady], (4.5, 3.0), cores=2)
    assert "load average (4.5) was above the 2 cores" in note


def test_the_rounds_interleave_the_settings_and_split_the_steps(tmp_path):
    """Every setting once, then every setting again: a busy minute lands on all of them."""
    from replicator.plan.benchmark import _run_all

    order = []

    def make_launch(setting):
        def launch():  # writes no rank files: every round fails, which is fine here
            import os

            order.append((setting.label, int(os.environ["REPLICATOR_BENCH_STEPS"])))

        return launch

    settings, _ = parse_settings("one_device,mirrored", "1,2", default_threads=2)
    report = _run_all("t", settings, [], str(tmp_path), 30, 1, make_launch, report=False,
                      quiet=True, rounds=3)
    labels = [s.label for s in settings]
    assert order == [(label, 10) for _ in range(3) for label in labels]
    assert [r.setting.label for r in report.results] == labels

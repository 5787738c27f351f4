"""The plots carry the data they were given, and the PNGs are real images."""

import pytest

from replicator.plan import plots

pytestmark = pytest.mark.skipif(not plots.available(), reason="matplotlib is not installed")


def _image_ok(path, min_bytes=8_000):
    import matplotlib.image as mpimg

    assert path.stat().st_size > min_bytes
    pixels = mpimg.imread(str(path))
    assert pixels.shape[0] > 300 and pixels.shape[1] > 400
    assert pixels.std() > 0.05  # not a blank canvas


def test_throughput_plot(tmp_path):
    path = tmp_path / "t.png"
    drawn = plots.throughput_plot({"mirrored": [(2, 180.0), (4, 300.0)]}, path, baseline=100.0,
                                  ceiling={1: 100.0, 2: 190.0, 4: 320.0})
    assert drawn["mirrored"] == [(2, 180.0), (4, 300.0)]
    assert drawn["linear scaling"][-1] == (4.0, 400.0)
    assert drawn["ceiling"][1] == (2.0, 190.0)
    _image_ok(path)


def test_breakdown_plot(tmp_path):
    path = tmp_path / "b.png"
    rows = [("one_device x1", {"compute": 0.010, "optimizer": 0.002, "input": 0.001}),
            ("mirrored x2", {"compute": 0.006, "communication": 0.003, "input": 0.001})]
    drawn = plots.breakdown_plot(rows, path)
    assert drawn["compute"] == [(0.0, 10.0), (1.0, 6.0)]
    assert drawn["communication"][1] == (1.0, 3.0)
    assert "checkpoint" not in drawn  # no empty parts
    _image_ok(path)


def test_plan_plot(tmp_path):
    path = tmp_path / "p.png"
    drawn = plots.plan_plot({"mirrored": [(2, 10.0), (8, 35.0)], "fsdp": [(2, 8.0), (8, 30.0)]},
                            path, recommended=(8, 35.0), misfits={"fsdp": [(2, 8.0)]})
    assert drawn["recommended"] == [(8, 35.0)] and len(drawn["fsdp"]) == 2
    _image_ok(path)

"""Output a user did not ask for: the scan for optimizers touches no deprecated torch object
(``torch.distributed.reduce_op`` warns on any attribute read), and another rank's long error
is cut at a word, with an ellipsis, in the launcher's summary."""

from __future__ import annotations

import warnings

import torch

from replicator.cluster.worker_errors import WorkerError
from replicator.launch.failure_report import RankEnd, clip, failure_for
from replicator.strategies.live.state import find_optimizers, find_schedulers


def test_scanning_live_objects_for_optimizers_raises_no_warning() -> None:
    import torch.distributed as dist

    assert dist.reduce_op is not None  # the deprecated object is alive in this process
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = find_optimizers([model])
        schedulers = find_schedulers(found)
    assert list(found.values()) == [optimizer]
    assert list(schedulers.values()) == [scheduler]


def test_a_long_error_is_cut_at_a_word_with_an_ellipsis() -> None:
    text = ("RuntimeError: " + "the launcher reports the first failure of every rank " * 6
            + "\nsecond line")
    cut = clip(text)
    assert len(cut) <= 200 and cut.endswith("...")
    assert text.startswith(cut[:-3]) and text[len(cut) - 3] == " "  # cut before a space
    assert clip("ValueError: short\nmore") == "ValueError: short"
    assert clip("x" * 300) == "x" * 197 + "..."  # one word longer than the limit


def test_the_summary_lists_another_ranks_long_error_cut_at_a_word() -> None:
    long = "the launcher reports the first failure, " * 8

    def error(rank: int, message: str, at: float) -> WorkerError:
        return WorkerError(rank, "ValueError", message, "Traceback ...", at, ("ValueError",))

    ends = [RankEnd(0, 1, 2.0, error(0, "bad input", 1.0)),
            RankEnd(1, 1, 3.0, error(1, long.strip(), 2.0))]
    failure, _ = failure_for(ends, 0, lambda r: "", None)
    (other,) = failure.others
    assert other.startswith("rank 1: ValueError: the launcher reports the first")
    assert "... (after rank 0 failed)" in other
    body = other.split(": ", 1)[1].removesuffix(" (after rank 0 failed)").removesuffix("...")
    assert f"ValueError: {long}".startswith(body + " ")  # whole words only

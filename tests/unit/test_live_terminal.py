"""One answer to "is this a live terminal" for every live display: a terminal of its own, or
the launcher's relay to one (``TTY_COMPATIBLE=1``)."""

from __future__ import annotations

import io

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp
from replicator.cluster.terminal import TTY_COMPATIBLE_ENV, is_live_terminal
from replicator.launch.output import terminal_env


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_launchers_word_decides_over_isatty(monkeypatch) -> None:
    monkeypatch.delenv(TTY_COMPATIBLE_ENV, raising=False)
    assert not is_live_terminal(io.StringIO()) and is_live_terminal(FakeTerminal())
    closed = io.StringIO()
    closed.close()
    assert not is_live_terminal(closed)
    monkeypatch.setenv(TTY_COMPATIBLE_ENV, "1")
    assert is_live_terminal(io.StringIO())
    monkeypatch.setenv(TTY_COMPATIBLE_ENV, "0")
    assert not is_live_terminal(FakeTerminal())


def test_the_launcher_sets_the_variable_the_displays_read() -> None:
    assert terminal_env(0, 2, FakeTerminal())[TTY_COMPATIBLE_ENV] == "1"
    assert TTY_COMPATIBLE_ENV not in terminal_env(1, 2, FakeTerminal())
    assert terminal_env(0, 2, io.StringIO()) == {}


@pytest.mark.parametrize("relayed", [True, False])
def test_progress_bar_is_live_when_the_launcher_relays_to_a_terminal(monkeypatch, capsys,
                                                                      relayed: bool) -> None:
    if relayed:
        monkeypatch.setenv(TTY_COMPATIBLE_ENV, "1")
    else:
        monkeypatch.delenv(TTY_COMPATIBLE_ENV, raising=False)
    data = TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    trainer = rp.Trainer(rp.OneDeviceStrategy("cpu"), lambda: torch.nn.Linear(3, 1),
                         lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.MSELoss())
    trainer.fit(DataLoader(data, batch_size=8), epochs=1)
    out = capsys.readouterr().out
    assert "epoch 1/1  step 4/4" in out  # the line kept at the epoch's end, either way
    assert ("━" in out) == relayed  # rich's bar only when live

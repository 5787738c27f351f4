"""A replica group listens on its bind address (127.0.0.1 by default): the state server that
heals peers and the group's store. The one exception is torchft's manager server, which torchft
0.2 binds to every interface with no option to narrow it (docs/fault_tolerance.md, Trust
model): exactly one listener, and no other, may be on every interface."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from replicator.testing.live_groups import start_group, start_lighthouse, wait_for_file
from tests.live_helpers import SCRIPT, env, needs_torchft

pytestmark = needs_torchft


def _listening(pid: int) -> list[str]:
    """``address:port`` of every TCP socket the process ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            raw, port = local.split(":")
            if width == 8:
                address = ".".join(str(int(raw[i:i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                address = "::" if int(raw, 16) == 0 else f"ipv6:{raw}"
            found.append(f"{address}:{int(port, 16)}")
    return found


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="needs Linux's /proc")
@pytest.mark.timeout(300)
def test_a_live_group_listens_on_loopback_only(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    lighthouse = start_lighthouse(1, log=out / "lighthouse.log")
    group = None
    try:
        group = start_group(SCRIPT, 0, 1, lighthouse.address, env=env(), log_dir=out,
                            args=["--out", str(out), "--samples", "96", "--epochs", "1",
                                  "--hold-at-step", "2", "--hold-for", "inspected"])
        wait_for_file(out / "progress_g0.txt", 200, "the group's first step", group)
        while (out / "progress_g0.txt").read_text() != "2":
            assert group.poll() == [None], (out / "group0_rank0.log").read_text()[-3000:]
            wait_for_file(out / "progress_g0.txt", 200, "the group's second step", group)
        sockets = _listening(group.processes[0].pid)
        (out / "inspected").write_text("1")
        assert group.wait(200) == [0], (out / "group0_rank0.log").read_text()[-3000:]
    finally:
        if group is not None:
            group.kill()
        lighthouse.stop()
    assert len(sockets) >= 2, sockets  # the manager server and the state server at least
    everywhere = [s for s in sockets if s.startswith(("::", "0.0.0.0:"))]
    assert len(everywhere) <= 1, sockets  # torchft's manager server only
    assert all(s.startswith("127.0.0.1:") for s in sockets if s not in everywhere), sockets

"""Every ```python block of README.md runs as written: each as its own script, in a fresh
temporary directory, in one process (``MirroredStrategy()`` under plain python is one replica).
New sections are picked up automatically; bash blocks are not run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SNIPPET_TIMEOUT_S = 240


def python_blocks(text: str) -> list[tuple[str, str]]:
    """``(heading, code)`` for every fenced python block, with the heading above it."""
    blocks, heading, code, inside = [], "(top)", [], False
    for line in text.splitlines():
        if not inside and re.match(r"#{1,6} ", line):
            heading = line.lstrip("#").strip()
        elif not inside and re.match(r"```python\s*$", line.strip()):
            inside, code = True, []
        elif inside and line.strip() == "```":
            inside = False
            blocks.append((heading, "\n".join(code) + "\n"))
        elif inside:
            code.append(line)
    if inside:
        raise ValueError(f"README.md: the python block under {heading!r} is never closed")
    return blocks


BLOCKS = python_blocks(README.read_text())


def _ids() -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for heading, _ in BLOCKS:
        seen[heading] = seen.get(heading, 0) + 1
        out.append(heading if seen[heading] == 1 else f"{heading} #{seen[heading]}")
    return out


def test_readme_has_python_snippets():
    assert len(BLOCKS) >= 4, [h for h, _ in BLOCKS]
    assert python_blocks("## A\n```python\nx = 1\n```\n```bash\nls\n```\n") == [("A", "x = 1\n")]


@pytest.mark.timeout(SNIPPET_TIMEOUT_S + 30)
@pytest.mark.parametrize("heading,code", BLOCKS, ids=_ids())
def test_readme_snippet_runs(heading, code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH"))
                                          if p))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG"):
        env.pop(var, None)  # plain python: one process, one replica
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"README snippet under {heading!r} ran past {SNIPPET_TIMEOUT_S} s\n"
                    f"{(exc.stderr or b'')[-3000:]!r}")
    if done.returncode != 0:
        pytest.fail(f"README snippet under {heading!r} failed (exit code {done.returncode}):\n"
                    f"{done.stderr[-4000:]}\n--- stdout ---\n{done.stdout[-1500:]}",
                    pytrace=False)

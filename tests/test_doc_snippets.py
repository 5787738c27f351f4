"""The documentation's scripts run as written: every ```python block of README.md, and in the
docs site's pages (docs/**/*.md) every block fenced as a named script, ```python title="x.py"
(plain ```python blocks there are fragments and do not run). Each runs as its own script in a
fresh temporary directory, in one process (``MirroredStrategy()`` under plain python is one
replica; a script that wants more starts them with ``rp.launch``), forked from an interpreter
that has imported torch and replicator already (tests/warm_python.py). New pages and sections are
picked up automatically; bash blocks are not run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.warm_python import WarmPython

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SNIPPET_TIMEOUT_S = 240
_FENCE = re.compile(r"```python(?P<info>[^\n`]*)$")


def python_blocks(text: str, where: str = "README.md", named_only: bool = False) \
        -> list[tuple[str, str]]:
    """``(heading, code)`` for every fenced python block (with ``named_only``, only those
    whose info string names a script: ``title="train.py"``), with the heading above it."""
    blocks, heading, code, inside, keep = [], "(top)", [], False, False
    for line in text.splitlines():
        fence = _FENCE.match(line.strip())
        if not inside and re.match(r"#{1,6} ", line):
            heading = line.lstrip("#").strip()
        elif not inside and fence:
            inside, code = True, []
            keep = not named_only or re.search(r'title="[^"]+\.py"', fence["info"]) is not None
        elif inside and line.strip() == "```":
            inside = False
            if keep:
                blocks.append((heading, "\n".join(code) + "\n"))
        elif inside:
            code.append(line)
    if inside:
        raise ValueError(f"{where}: the python block under {heading!r} is never closed")
    return blocks


def _all_blocks() -> list[tuple[str, str, str]]:
    found = [("README.md", h, c) for h, c in python_blocks(README.read_text())]
    for page in sorted(DOCS.rglob("*.md")):
        name = page.relative_to(ROOT).as_posix()
        found += [(name, h, c) for h, c in python_blocks(page.read_text(), name, True)]
    return found


BLOCKS = _all_blocks()


def _ids() -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for where, heading, _ in BLOCKS:
        key = f"{where}: {heading}"
        seen[key] = seen.get(key, 0) + 1
        out.append(key if seen[key] == 1 else f"{key} #{seen[key]}")
    return out


def test_the_docs_have_python_snippets():
    assert sum(w == "README.md" for w, _, _ in BLOCKS) >= 1, [h for _, h, _ in BLOCKS]
    assert any(w.startswith("docs/migration/") for w, _, _ in BLOCKS), "no migration script"
    assert python_blocks("## A\n```python\nx = 1\n```\n```bash\nls\n```\n") == [("A", "x = 1\n")]
    page = '## A\n```python\nx = 1\n```\n```python title="t.py"\ny = 2\n```\n'
    assert python_blocks(page, named_only=True) == [("A", "y = 2\n")]


def _snippet_env() -> dict[str, str]:
    src = str(ROOT / "src")
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH"))
                                          if p))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG",
                "REPLICATOR_PRELOAD"):
        env.pop(var, None)  # plain python: one process, one replica, nothing of the tests
    return env


@pytest.fixture(scope="module")
def warm_python():
    """One interpreter with torch and replicator imported, forking a child per snippet (each
    snippet still its own process, as ``__main__``, from its own directory)."""
    runner = WarmPython(_snippet_env())
    yield runner
    runner.close()


def _run_fresh(script: Path, cwd: Path) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, str(script)], cwd=cwd, env=_snippet_env(),
                          capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.timeout(SNIPPET_TIMEOUT_S + 90)
@pytest.mark.parametrize("where,heading,code", BLOCKS, ids=_ids())
def test_doc_snippet_runs(where, heading, code, tmp_path, warm_python):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    try:
        ran = warm_python.run(script, tmp_path, SNIPPET_TIMEOUT_S) or _run_fresh(script,
                                                                                 tmp_path)
    except (subprocess.TimeoutExpired, TimeoutError) as exc:
        pytest.fail(f"{where} snippet under {heading!r} ran past {SNIPPET_TIMEOUT_S} s\n"
                    f"{exc}")
    code_, stdout, stderr = ran
    if code_ != 0:
        pytest.fail(f"{where} snippet under {heading!r} failed (exit code {code_}):"
                    f"\n{stderr[-4000:]}\n--- stdout ---\n{stdout[-1500:]}", pytrace=False)

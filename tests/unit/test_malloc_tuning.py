"""The launcher's workers keep a step's large buffers in the heap (cluster/malloc_tuning)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from replicator.launch.malloc_tuning import tune_malloc

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(platform.system() != "Linux", reason="glibc's malloc")]

# a step's 40 MB activation, allocated, touched and freed 20 times: above glibc's largest
# mmap threshold (32 MB) every one is fresh pages from the kernel, faulted in page by page
FAULTS = textwrap.dedent("""
    import resource, torch
    def faults():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(20):
            torch.empty(10 << 20).fill_(1.0)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    faults()
""")
PAGES_PER_BUFFER = (40 << 20) // 4096


def _run(env_extra: dict[str, str], *args: str) -> str:
    """Run ``python *args`` without any malloc setting of this environment; its stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("REPLICATOR_MALLOC", None)
    env.update(env_extra)
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                         timeout=100, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_tuned_process_reuses_its_heap_where_glibc_faults_every_buffer_in():
    tuned = FAULTS + ("from replicator.launch.malloc_tuning import tune_malloc\n"
                      "assert tune_malloc()\nprint(faults())\n")
    plain = FAULTS + "print(faults())\n"
    faults_plain = int(_run({}, "-c", plain))
    faults_tuned = int(_run({}, "-c", tuned))
    assert faults_plain >= 15 * PAGES_PER_BUFFER  # fresh pages for every buffer
    # the first one, then the heap's own: about a twentieth; a busy machine adds faults to
    # both (51,144 beside four CPU hogs where a quiet run counts about 10,240)
    assert faults_tuned * 3 <= faults_plain


def test_workers_started_by_the_launcher_are_tuned_unless_the_user_opts_out(tmp_path):
    script = tmp_path / "faults.py"
    script.write_text(FAULTS + "print(faults())\n")
    entry = ("-m", "replicator.launch.script_entry", str(script))
    tuned, plain = int(_run({}, *entry)), int(_run({"REPLICATOR_MALLOC": "default"}, *entry))
    assert plain >= 15 * PAGES_PER_BUFFER and tuned * 3 <= plain


def test_the_users_own_glibc_tunables_and_opt_out_are_left_alone(monkeypatch):
    monkeypatch.setenv("REPLICATOR_MALLOC", "default")
    assert tune_malloc() is False
    monkeypatch.setenv("REPLICATOR_MALLOC", "auto")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert tune_malloc() is False


def test_an_unknown_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("REPLICATOR_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="REPLICATOR_MALLOC='jemalloc' is not one of auto, "
                                         "default. HINT"):
        tune_malloc()

"""The saver process's local writes: direct I/O for the aligned whole blocks, the page cache for
the tail and for file systems without direct I/O; the bytes and the SHA-256 exact either way."""

from __future__ import annotations

import hashlib
import mmap
import os
import runpy
from pathlib import Path

import pytest

from replicator.checkpoint import saver_process
from replicator.checkpoint.saver import StagingBuffer

SIZES = [0, 1, 4095, 4096, 4097, 3 * 4096 + 17, saver_process.CHUNK + 5000]


def _image(size: int) -> mmap.mmap:
    mm = mmap.mmap(-1, max(size, 1))
    mm[:size] = os.urandom(size)
    return mm


def _direct_supported(directory: Path) -> bool:
    fd, direct = saver_process.open_for_write(str(directory / "probe"), True)
    os.close(fd)
    os.unlink(directory / "probe")
    return direct


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("aligned", [True, False])
def test_local_writes_are_exact_and_hashed(tmp_path, size, aligned):
    mm = _image(size)
    view = memoryview(mm)[:size]
    dest = tmp_path / "file.safetensors"
    written, digest = saver_process.write_local(view, str(dest), aligned)
    expected = bytes(mm[:size])
    assert written == size and dest.read_bytes() == expected
    assert digest == hashlib.sha256(expected).hexdigest()
    view.release()


def test_a_direct_write_the_file_system_refuses_goes_through_the_page_cache(tmp_path):
    """A misaligned buffer under O_DIRECT is refused (EINVAL) by disk file systems: the write
    turns direct I/O off and completes buffered, byte for byte."""
    if not _direct_supported(tmp_path):
        pytest.skip(f"{tmp_path} does not take O_DIRECT (writes there are buffered anyway)")
    mm = _image(3 * 4096 + 1)
    fd, direct = saver_process.open_for_write(str(tmp_path / "f"), True)
    try:
        assert direct
        still_direct = saver_process._write_all(fd, memoryview(mm)[1:], True)
    finally:
        os.close(fd)
    assert not still_direct
    assert (tmp_path / "f").read_bytes() == bytes(mm)[1:]


def test_staged_images_start_on_direct_io_boundaries():
    import torch

    buffer = StagingBuffer()
    try:
        staged, _ = buffer.stage({
            "a": ({"w": torch.randn(3, 5)}, {}),
            "b": ({"v": torch.arange(7, dtype=torch.int64)}, {"k": "v"}),
            "c": ({"x": torch.zeros(1000)}, {}),
        })
        assert all(f.offset % saver_process.DIRECT_ALIGN == 0 for f in staged.values())
    finally:
        buffer.close()


def test_the_saver_program_runs_without_replicator_on_its_path(tmp_path):
    """It is started as a plain script (standard library and fsspec only)."""
    namespace = runpy.run_path(saver_process.__file__)
    assert "write_local" in namespace and "replicator" not in " ".join(
        line for line in Path(saver_process.__file__).read_text().splitlines()
        if line.startswith(("import ", "from ")))

"""A real S3-compatible server for the tests: moto's standalone server on a loopback port.

It speaks the S3 HTTP protocol to ``s3fs`` as AWS does. Credentials and the endpoint reach
the code under test the documented way: ``AWS_*`` variables and ``FSSPEC_S3_ENDPOINT_URL``
(set in this process and passed to every worker it starts).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_SESSION_TOKEN": "testing",
               "AWS_EC2_METADATA_DISABLED": "true"}
#: Objects stay in the server's memory (moto spills each object over 5 MB to a temporary
#: file by default, at more CPU than the upload itself on a busy 2-core machine).
SERVER_SETTINGS = {"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(256 << 20)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """``python -m moto.server`` on 127.0.0.1; stop, pause and resume it like a real outage."""

    def __init__(self, log_path: str) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**CREDENTIALS, "FSSPEC_S3_ENDPOINT_URL": self.endpoint}

    def start(self, timeout: float = 90.0) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **CREDENTIALS,
                                                     **SERVER_SETTINGS})
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto's S3 server exited with code {self.proc.returncode}; "
                                   f"see {self.log_path}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=5).read()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"moto's S3 server did not answer on {self.endpoint} in {timeout} s")

    def make_bucket(self, name: str) -> None:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True).mkdir(name)

    def pause(self) -> None:
        """SIGSTOP: connections are accepted but never answered (a hung server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Gone for good: the process is killed, its port refuses connections."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    """A moto S3 server for the module, with the AWS_* and endpoint variables set."""
    server = S3Server(str(tmp_path_factory.mktemp("moto") / "moto.log"))
    server.start()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

"""A loopback S3 server for the benchmarks: moto's standalone server on 127.0.0.1."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


class LoopbackS3:
    """moto's standalone S3 server on 127.0.0.1, with the AWS_* and endpoint variables set for
    this process and the workers it starts."""

    def __init__(self, tmp: Path, niceness: int = 0) -> None:
        import socket
        import subprocess
        import urllib.request

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": self.endpoint}
        os.environ.update(env)
        log = open(tmp / "moto.log", "wb")
        # objects stay in the server's memory: by default moto spills every object over 5 MB
        # to a temporary file, which cost more CPU than the upload itself (S3 runs elsewhere;
        # this server shares the benchmark's 2 cores)
        server_env = {**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(256 << 20)}
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                      "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                     env=server_env,
                                     preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"moto's S3 server did not start; see {tmp}/moto.log"
                                       ) from None
                time.sleep(0.2)
        import s3fs

        s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True).mkdir("bench")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

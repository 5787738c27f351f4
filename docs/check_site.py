"""Check the documentation site in a real browser: build it, serve it on loopback, take
screenshots of the home page, a strategy page and an API page in headless Chromium, and
assert that the site's search finds ``BackupAndRestore``.

    python docs/check_site.py --out shots/        # needs mkdocs (.[docs]) and chromium
    apt-get update && apt-get install -y chromium  # Debian's package; no browser download

Screenshots come from Chromium's command line (``--screenshot``); the search runs in a web
worker after the page loads, so it is driven through the DevTools protocol (a websocket on
loopback, spoken here with the standard library only): open ``/?q=BackupAndRestore``, wait
for the result list, read it, screenshot it. Exits 0 when every check passes.
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGES = {"home.png": "", "strategy.png": "strategies/mirrored/",
         "api.png": "reference/callbacks/"}
QUERY = "BackupAndRestore"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--window-size=1280,900"]


def build_site(site: Path) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f",
                    str(ROOT / "mkdocs.yml"), "-d", str(site)], check=True, env=env, cwd=ROOT)


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve ``site`` on 127.0.0.1 (a free port) from a thread; returns the server and URL."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


def screenshot(browser: str, url: str, out: Path, profile: Path) -> None:
    subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=5000",
                    f"--screenshot={out}", url], check=True, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not out.exists() or out.stat().st_size < 10_000:
        raise SystemExit(f"FAIL: no screenshot of {url} (or an empty one): {out}")


# -- the DevTools protocol over a minimal websocket client (RFC 6455, client side) ---------------
class DevTools:
    def __init__(self, ws_url: str) -> None:
        rest = ws_url.removeprefix("ws://")
        hostport, path = rest.split("/", 1)
        host, port = hostport.split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += self.sock.recv(4096)
        if b" 101 " not in reply.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"the DevTools websocket refused the upgrade: {reply[:200]!r}")
        self._buffer = reply.split(b"\r\n\r\n", 1)[1]
        self._next_id = 0

    def _read(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the browser closed the DevTools connection")
            self._buffer += chunk
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out

    def _send(self, text: str) -> None:
        payload, mask = text.encode(), os.urandom(4)
        n = len(payload)
        header = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else
                                  bytes([0x80 | 126]) + struct.pack(">H", n) if n < 65536 else
                                  bytes([0x80 | 127]) + struct.pack(">Q", n))
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def _receive(self) -> dict[str, Any]:
        message = b""
        while True:
            first, second = self._read(2)
            n = second & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            data = self._read(n)
            if first & 0x0F in (0x1, 0x0):  # text, or its continuation
                message += data
                if first & 0x80:  # the final fragment
                    return json.loads(message)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        self._send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            reply = self._receive()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")


def search_results(browser: str, url: str, profile: Path, shot: Path,
                   wait_seconds: float = 60.0) -> list[str]:
    """Open the site with ``?q=QUERY`` and return what the search lists: per result, the
    page title and its matching sections, as shown (the first 200 characters)."""
    proc = subprocess.Popen([browser, *FLAGS, f"--user-data-dir={profile}",
                             "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("FAIL: chromium did not open its DevTools port")
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        tools = DevTools(page["webSocketDebuggerUrl"])
        tools.call("Page.enable")
        tools.call("Page.navigate", url=f"{url}?q={QUERY}")
        titles: list[str] = []
        deadline = time.monotonic() + wait_seconds
        while not titles and time.monotonic() < deadline:
            time.sleep(0.5)
            titles = tools.evaluate(
                "Array.from(document.querySelectorAll('.md-search-result__item'))"
                ".map(e => e.innerText.replace(/\\s+/g, ' ').slice(0, 200))") or []
        data = tools.call("Page.captureScreenshot", format="png")["data"]
        shot.write_bytes(base64.b64decode(data))
        return titles
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="site-check", help="folder for the screenshots")
    parser.add_argument("--site", default=None, help="a built site (default: build one)")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("FAIL: no chromium. HINT: apt-get update && apt-get install -y chromium")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="replicator-site-") as tmp:
        site = Path(args.site) if args.site else Path(tmp) / "site"
        if args.site is None:
            build_site(site)
        server, url = serve(site)
        try:
            for name, page in PAGES.items():
                screenshot(browser, url + page, (out / name).resolve(),
                           Path(tmp) / f"profile-{name}")
                print(f"ok: {url + page} -> {out / name}")
            titles = search_results(browser, url, Path(tmp) / "profile-search",
                                    (out / "search.png").resolve())
        finally:
            server.shutdown()
    found = [t for t in titles if QUERY in t]
    print(f"search for {QUERY!r}: {len(titles)} results; the first: {titles[:1]}")
    if not found:
        print(f"FAIL: the site's search does not find {QUERY}")
        return 1
    print(f"ok: the search finds {QUERY} in {len(found)} results; screenshot {out / 'search.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prints ``ready`` and waits (at most 60 s) for the launcher to stop it; saves no backup."""

import time

print("ready", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.1)

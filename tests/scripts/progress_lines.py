"""Rank 0 redraws a progress line with carriage returns while the other ranks print lines.

Usage: progress_lines.py [STEPS]. Rank 0 writes ``\\rstep i/STEPS`` every 0.1 s and ends the
bar with ``\\rstep STEPS/STEPS done\\n``; every other rank prints ``rank R line i`` STEPS times
at once.
"""

import os
import sys
import time

rank = int(os.environ.get("RANK", "0"))
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
for i in range(1, steps + 1):
    if rank == 0:
        sys.stdout.write(f"\rstep {i}/{steps}")
        sys.stdout.flush()
        time.sleep(0.1)
    else:
        print(f"rank {rank} line {i}", flush=True)
if rank == 0:
    sys.stdout.write(f"\rstep {steps}/{steps} done\n")
    sys.stdout.flush()

"""Every rank prints many long lines to stdout and stderr at once, in several writes per line.

Usage: print_lines.py [LINES] [WIDTH]. Each line is ``r{rank}-{i}:`` + WIDTH copies of the
rank's letter + ``:end``, written in pieces so that a relay that forwarded bytes as they came
would tear it.
"""

import os
import sys

rank = int(os.environ.get("RANK", "0"))
lines = int(sys.argv[1]) if len(sys.argv) > 1 else 200
width = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
letter = "abcdefghij"[rank % 10]
for i in range(lines):
    stream = sys.stdout if i % 2 == 0 else sys.stderr
    body = letter * width
    stream.write(f"r{rank}-{i}:")
    stream.write(body[: width // 2])
    stream.flush()
    stream.write(body[width // 2:])
    stream.write(":end\n")
    stream.flush()
sys.stdout.write(f"r{rank} last line without a newline")

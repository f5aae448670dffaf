"""Instructions a command executes, under valgrind's callgrind: a measure that does not move with
the machine's load, for before/after comparisons on a shared VM (where wall and CPU time move by
2x between runs of one tree).

A benchmark counts a command run twice, doing k1 and k2 units of work, and divides the difference
by k2 - k1: start-up (imports, allocating the arena) cancels out. PYTHONHASHSEED=0, so dict and set
orders, and with them the instructions, are the same in every run; a figure still moves by ~1-2%
between builds of the same code (where objects land in memory: identity hashes). valgrind must be
installed (`apt-get install valgrind`); `available()` says whether it is.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence


def available() -> bool:
    return shutil.which("valgrind") is not None


def instructions(argv: Sequence[str]) -> int:
    """Instructions executed by the command `argv` (all its threads), under callgrind."""
    # OpenBLAS's idle threads spin for a while: their instructions would grow with the run's wall time
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode or found is None:
        raise RuntimeError(f"{' '.join(argv)} under callgrind exited {done.returncode}: {done.stderr[-2000:]}")
    return int(found.group(1))


def instructions_many(commands: Sequence[Sequence[str]], jobs: int = 2) -> list[int]:
    """`instructions` of each command, `jobs` at a time (a count does not depend on the load)."""
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(instructions, commands))

"""The codec's compiled loops when numba is installed (kvstore/codec_loops.py), loaded at their first use.

`AVAILABLE` (whether they run), `encode_groups`, `decode_groups` (and the
loops' helpers) are read from this module; the first read imports numba and
the loops (~0.15 s: not on the daemon's way to its ready line, nor in a process
that never encodes). Without numba, or with `KVSTORE_CODEC_NUMPY=1`,
`AVAILABLE` is False and the codec runs its NumPy code (kvstore/codec.py): the
same bytes, several times slower. numba is optional (the `fast` extra; vLLM
installs it).
"""

from __future__ import annotations

import os

_loops = None  # kvstore.codec_loops once loaded; False where it cannot run


def _load():
    global _loops
    if _loops is None:
        _loops = False
        if os.environ.get("KVSTORE_CODEC_NUMPY") != "1":
            try:
                from kvstore import codec_loops
            except ImportError:  # no numba: the NumPy code serves
                pass
            else:
                _loops = codec_loops
    return _loops


def __getattr__(name: str):
    if name == "AVAILABLE":
        return bool(_load())
    loops = _load()
    if loops and not name.startswith("__"):
        return getattr(loops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Reading one request frame off a connection, within the size limit that applies to it.

The length prefix is checked before a byte of the body is read, so a frame over
the limit costs no memory. Its body is left unread; the daemon answers and
closes, and may first `discard` the body (in pieces, never held whole) so that
the peer's send completes and it reads the answer instead of a connection reset.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvstore.protocol import HEADER

DISCARD_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Oversize:
    """A frame whose length prefix is over the limit; its body has not been read."""

    length: int


async def read_frame(reader: asyncio.StreamReader, limit: int) -> bytes | Oversize | None:
    """The next frame's body; Oversize when it is longer than `limit`; None at EOF or on a cut frame."""
    try:
        (length,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        if length > limit:
            return Oversize(length)
        return await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


async def discard(reader: asyncio.StreamReader, nbytes: int) -> None:
    """Read and drop `nbytes` (fewer if the peer goes away first)."""
    while nbytes > 0:
        try:
            chunk = await reader.read(min(nbytes, DISCARD_CHUNK_BYTES))
        except ConnectionError:
            return
        if not chunk:
            return
        nbytes -= len(chunk)

"""Reading one request frame off a connection, within the size limit that applies to it.

The length prefix is checked before a byte of the body is read, so a frame over
the limit costs no memory. Its body is left unread; the daemon answers and
closes (the stream cannot be resynchronised without the body). Before closing it
may `discard` what of the body arrives (in pieces, never held whole) so that a
peer whose send is under way completes it and reads the answer instead of a
connection reset; the discard is bounded in time, so a peer that sent only the
length prefix (or drips the body) is closed within DISCARD_IDLE_S (at most
DISCARD_MAX_S), never kept open waiting for a body that does not come.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvstore.protocol import HEADER

DISCARD_CHUNK_BYTES = 1 << 20
DISCARD_IDLE_S = 1.0  # a discard ends when the peer sends nothing for this long
DISCARD_MAX_S = 10.0  # ... and after this long in any case


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


async def discard(reader: asyncio.StreamReader, nbytes: int, idle_s: float = DISCARD_IDLE_S,
                  max_s: float = DISCARD_MAX_S) -> int:
    """Read and drop up to `nbytes`: fewer if the peer goes away, sends nothing for `idle_s`, or `max_s`
    passes. Returns the bytes dropped."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_s
    dropped = 0
    while dropped < nbytes:
        wait_s = min(idle_s, deadline - loop.time())
        if wait_s <= 0:
            break
        try:
            chunk = await asyncio.wait_for(reader.read(min(nbytes - dropped, DISCARD_CHUNK_BYTES)), wait_s)
        except (ConnectionError, asyncio.TimeoutError):
            break
        if not chunk:
            break
        dropped += len(chunk)
    return dropped

"""Remote (TCP) `put` and `get`: payloads inline, cut into frames under the daemon's limit.

The daemon announces `max_frame_bytes` and `max_batch_blocks` at hello. A put or
a get is sent as requests of at most `inline_blocks_per_frame` blocks (and at
most `max_batch_blocks`), so no request this client sends, and no reply it asks
for, is over the limit: a large put is several frames, never a reset. A block
that fits in no frame raises ProtocolError naming the limit before anything is
sent. A get needs the namespace's block size, which the client learns when it
registers the namespace; for one it did not register it sends one request and
the daemon says how many blocks fit. A daemon that announces no limit (older)
gets one request, as before.

Requests go one after the other: a put's blocks are committed frame by frame,
so a child in a later frame finds its parent already stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvstore.errors import ProtocolError
from kvstore.protocol import inline_blocks_per_frame

if TYPE_CHECKING:
    from kvstore.client import Block, KVClient


def put_inline(client: "KVClient", ns_id: str, blocks: Sequence["Block"]) -> int:
    if not blocks:
        return 0
    per = _blocks_per_frame(client, max(memoryview(data).nbytes for _, _, data in blocks), len(blocks))
    stored = 0
    for i in range(0, len(blocks), per):
        wire = [[h, p, bytes(memoryview(data).cast("B"))] for h, p, data in blocks[i : i + per]]
        stored += client.call("put", ns=ns_id, blocks=wire)["stored"]
    return stored


def get_inline(client: "KVClient", ns_id: str, hashes: Sequence[bytes]) -> list[np.ndarray | None]:
    block_bytes = client.block_bytes_of(ns_id)
    per = len(hashes) if block_bytes is None else _blocks_per_frame(client, block_bytes, len(hashes))
    out: list[np.ndarray | None] = []
    for i in range(0, len(hashes), max(per, 1)):
        payloads = client.call("get", ns=ns_id, hashes=list(hashes[i : i + per]))["payloads"]
        out += [None if p is None else np.frombuffer(p, np.uint8) for p in payloads]
    return out


def _blocks_per_frame(client: "KVClient", block_bytes: int, wanted: int) -> int:
    max_frame = client.server_info.get("max_frame_bytes")
    per = wanted if max_frame is None else inline_blocks_per_frame(max_frame, block_bytes)
    if per == 0:
        raise ProtocolError(f"a block of {block_bytes} B does not fit in the daemon's frame limit of {max_frame} B "
                            "(server.max_frame): raise it to send such blocks over TCP")
    return max(1, min(per, client.server_info.get("max_batch_blocks") or per))

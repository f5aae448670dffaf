"""The data-plane wire format, shared by the daemon and the client.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack.
A request is `[msgid, op, args]` (int, str, map); a reply is
`[msgid, error, result]` where error is None or `{"type": name, "message": text}`.
Requests are batches (a list of hashes per call): one round trip per engine
step, never one per block.

Validation helpers (`want_*`) raise ProtocolError with a message naming the
offending field; the daemon turns that into an error reply and changes nothing.

Frame sizes: the daemon announces `max_frame_bytes` and `max_batch_blocks` at
hello. A request of `max_batch_blocks` hashes or [hash, parent] pairs always
fits a frame (ServerConfig checks `metadata_frame_bytes`); requests and replies
that carry payloads inline are cut by the client into `inline_blocks_per_frame`
blocks, and the daemon refuses a `get` whose reply would not fit.
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

import msgpack

from kvstore.errors import ProtocolError
from kvstore.keys import HASH_BYTES

HEADER = struct.Struct(">I")
PROTOCOL_VERSION = 1

# Upper bounds on msgpack sizes, so both sides can plan frames without packing twice.
REQUEST_OVERHEAD_BYTES = 1024  # [msgid, op, {ns, flags, ...}] around the per-block lists
METADATA_BYTES_PER_BLOCK = 40  # [hash, parent] = 37 B; hash + attention float = 27 B
INLINE_BYTES_PER_BLOCK = 48  # [hash, parent, bin32 payload] = 42 B besides the payload


def metadata_frame_bytes(num_blocks: int) -> int:
    """The largest frame a request of `num_blocks` hashes or [hash, parent] pairs can need."""
    return REQUEST_OVERHEAD_BYTES + num_blocks * METADATA_BYTES_PER_BLOCK


def inline_blocks_per_frame(max_frame_bytes: int, block_bytes: int) -> int:
    """How many payloads of `block_bytes` fit in one frame of `max_frame_bytes` (0: not even one)."""
    return max(0, (max_frame_bytes - REQUEST_OVERHEAD_BYTES) // (block_bytes + INLINE_BYTES_PER_BLOCK))


_PACKER = msgpack.Packer(use_bin_type=True)  # `pack` holds the GIL throughout: one Packer serves every thread


def pack_frame(obj: Any) -> bytes:
    body = _PACKER.pack(obj)  # (packb would make a Packer per frame)
    return HEADER.pack(len(body)) + body


def unpack_body(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=len(body))
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"frame is not valid msgpack: {type(exc).__name__}") from None


def parse_request(obj: Any) -> tuple[int, str, dict]:
    if not (isinstance(obj, list) and len(obj) == 3):
        raise ProtocolError("a request must be [msgid, op, args]")
    msgid, op, args = obj
    if not isinstance(msgid, int) or isinstance(msgid, bool) or not 0 <= msgid < 2**63:
        raise ProtocolError("msgid must be a non-negative int")
    if not isinstance(op, str):
        raise ProtocolError("op must be a string")
    if not isinstance(args, dict):
        raise ProtocolError("args must be a map")
    return msgid, op, args


def want(args: dict, name: str, kind: type | tuple, optional: bool = False) -> Any:
    if name not in args:
        if optional:
            return None
        raise ProtocolError(f"missing argument {name!r}")
    value = args[name]
    if value is None and optional:
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ProtocolError(f"argument {name!r} has the wrong type ({type(value).__name__})")
    return value


def want_hash(value: Any, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != HASH_BYTES:
        raise ProtocolError(f"{what} must be {HASH_BYTES} bytes")
    return value


_HASH_LEN = {HASH_BYTES}


def want_hashes(args: dict, limit: int, name: str = "hashes") -> list[bytes]:
    hashes = want(args, name, list)
    if len(hashes) > limit:
        raise ProtocolError(f"{len(hashes)} blocks in one request; the limit is {limit}")
    if hashes and (list(map(type, hashes)).count(bytes) != len(hashes) or {*map(len, hashes)} != _HASH_LEN):
        for i, h in enumerate(hashes):  # name the first offender
            want_hash(h, f"{name}[{i}]")
    return hashes


def want_blocks(args: dict, limit: int, with_payload: bool) -> list[Sequence]:
    """`blocks`: [[hash, parent|None(, payload)], ...], each as sent (a list: unpack it)."""
    blocks = want(args, "blocks", list)
    if len(blocks) > limit:
        raise ProtocolError(f"{len(blocks)} blocks in one request; the limit is {limit}")
    width = 3 if with_payload else 2
    if not blocks:
        return blocks
    if set(map(type, blocks)) == {list} and set(map(len, blocks)) == {width}:  # checked per column, in C
        hashes = [b[0] for b in blocks]
        parents = [b[1] for b in blocks if b[1] is not None]
        payloads = {bytes} if not with_payload else set(map(type, [b[2] for b in blocks]))
        if (set(map(type, hashes)) == {bytes} and set(map(len, hashes)) == {HASH_BYTES} and payloads == {bytes}
                and (not parents or (set(map(type, parents)) == {bytes} and set(map(len, parents)) == {HASH_BYTES}))):
            return blocks
    out = []  # name the first offender
    for i, b in enumerate(blocks):
        if not isinstance(b, list) or len(b) != width:
            raise ProtocolError(f"blocks[{i}] must be a list of {width} items")
        h = want_hash(b[0], f"blocks[{i}] hash")
        parent = None if b[1] is None else want_hash(b[1], f"blocks[{i}] parent")
        if with_payload:
            if not isinstance(b[2], bytes):
                raise ProtocolError(f"blocks[{i}] payload must be bytes")
            out.append((h, parent, b[2]))
        else:
            out.append((h, parent))
    return out


def want_token_blocks(args: dict, count: int) -> list[bytes | None] | None:
    """`tokens`: per block, its token ids as little-endian uint32 bytes, or None (optional; for KV events)."""
    values = want(args, "tokens", list, optional=True)
    if values is None:
        return None
    if len(values) != count or not all(v is None or isinstance(v, bytes) for v in values):
        raise ProtocolError(f"'tokens' must be a list of {count} items, each bytes (<u4 token ids) or nil")
    return values


def want_floats(args: dict, name: str, count: int) -> list[float] | None:
    values = want(args, name, list, optional=True)
    if values is None:
        return None
    if len(values) != count or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ProtocolError(f"{name!r} must be a list of {count} numbers")
    return [float(v) for v in values]

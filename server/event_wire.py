"""vLLM's KV-event wire format (`vllm/distributed/kv_events.py`), written and read without vLLM.

A message on the PUB socket is three frames: topic, an 8-byte big-endian
sequence number, and a msgpack payload: a `KVEventBatch`, the array
`[ts, events, data_parallel_rank]`. Each event is one of

    BlockStored      block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name
    BlockRemoved     block_hashes, medium
    AllBlocksCleared

in one of two encodings (msgspec tagged unions). "map", vLLM's current one
(vLLM 0.32 decodes it): a map with a "type" key naming the class, optional
fields left out. "array", the earlier one: `[class name, fields...]` in field
order. Consumers were broken by the switch, so `decode_batch` reads both.

What this daemon puts in them: its own chained block hashes (16 bytes,
kvstore/keys.py), the parent's hash (None for a chain's first block), the
block's token ids when the engine sent them (else []), `block_size` = the
namespace's tokens per block, and `medium` per tier: gpu -> GPU, host -> CPU,
disk -> STORAGE, remote -> STORAGE with `locality` REMOTE. Consecutive
blocks of one chain stored into one tier in one batch are one BlockStored (as
vLLM sends them); consecutive removals from one tier are one BlockRemoved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import numpy as np

STORED, REMOVED, CLEARED = "S", "R", "C"
MEDIUM = {"gpu": "GPU", "host": "CPU", "disk": "STORAGE", "remote": "STORAGE"}
LOCALITY = {"remote": "REMOTE"}
TIER_OF = {("GPU", None): "gpu", ("CPU", None): "host", ("STORAGE", None): "disk", ("STORAGE", "REMOTE"): "remote"}
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
REMOVED_FIELDS = ("block_hashes", "medium")


@dataclass(frozen=True, slots=True)
class RawEvent:
    """One block entering (STORED) or leaving (REMOVED) a tier, or a namespace CLEARED, as the loop saw it."""

    kind: str
    topic: bytes
    block_tokens: int = 0
    block_hash: bytes = b""
    parent: bytes | None = None
    tokens: bytes | None = None  # <u4 token ids
    tier: str = ""


@dataclass
class _Run:
    """Events merged into one: consecutive blocks of a chain into one tier, or removals from one tier."""

    kind: str
    tier: str
    block_tokens: int
    parent: bytes | None
    hashes: list = field(default_factory=list)
    tokens: list = field(default_factory=list)  # per block: bytes, or None when not sent

    def takes(self, ev: RawEvent) -> bool:
        if ev.kind != self.kind or ev.tier != self.tier or self.kind == CLEARED:
            return False
        if self.kind == REMOVED:
            return True
        return (ev.parent == self.hashes[-1] and ev.block_tokens == self.block_tokens
                and (ev.tokens is None) == (self.tokens[-1] is None))


def group_by_topic(events: Sequence[RawEvent]) -> dict[bytes, list[_Run]]:
    """Each topic's events in order, runs merged."""
    out: dict[bytes, list[_Run]] = {}
    for ev in events:
        runs = out.setdefault(ev.topic, [])
        if ev.kind == CLEARED:
            if not (runs and runs[-1].kind == CLEARED):
                runs.append(_Run(CLEARED, "", 0, None))
            continue
        if runs and runs[-1].takes(ev):
            runs[-1].hashes.append(ev.block_hash)
            runs[-1].tokens.append(ev.tokens)
        else:
            runs.append(_Run(ev.kind, ev.tier, ev.block_tokens, ev.parent, [ev.block_hash], [ev.tokens]))
    return out


def _token_ids(tokens: list) -> list[int]:
    if not tokens or tokens[0] is None:
        return []
    return np.frombuffer(b"".join(tokens), "<u4").tolist()


def _event(run: _Run, encoding: str) -> Any:
    if run.kind == CLEARED:
        return {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]
    medium = MEDIUM[run.tier]
    if run.kind == REMOVED:
        values: tuple = (run.hashes, medium)
        name, names = "BlockRemoved", REMOVED_FIELDS
    else:
        values = (run.hashes, run.parent, _token_ids(run.tokens), run.block_tokens, None, medium, None)
        name, names = "BlockStored", STORED_FIELDS
    if encoding == "array":
        return [name, *values]  # locality would come five optional fields later: left out
    event = {"type": name, **dict(zip(names, values))}
    if run.tier in LOCALITY:
        event["locality"] = LOCALITY[run.tier]
    return event


def encode_batch(runs: list[_Run], ts: float, encoding: str) -> bytes:
    """One KVEventBatch: [ts, events, data_parallel_rank] (rank 0, as a vLLM engine without DP sends)."""
    return msgpack.packb([ts, [_event(r, encoding) for r in runs], 0], use_bin_type=True)


# -- reading (`kvstore events`, tests) -------------------------------------------------------
class WireError(ValueError):
    """A payload that is not a KVEventBatch in either encoding."""


def _as_map(event: Any) -> dict:
    if isinstance(event, dict) and isinstance(event.get("type"), str):
        return dict(event)
    if isinstance(event, list) and event and isinstance(event[0], str):
        names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(event[0], ())
        return {"type": event[0], **dict(zip(names, event[1:]))}
    raise WireError(f"not a KV event: {event!r:.80}")


def decode_batch(payload: bytes) -> dict:
    """{"ts", "events": [{"type", fields..., "tier"}], "data_parallel_rank"} from either encoding;
    each block event gets `tier`, this daemon's name for its medium (and locality)."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"payload is not msgpack: {type(exc).__name__}") from None
    if not (isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list)):
        raise WireError("payload is not a KVEventBatch [ts, events, ...]")
    events = [_as_map(e) for e in batch[1]]
    for e in events:
        if "medium" in e:
            e["tier"] = TIER_OF.get((e["medium"], e.get("locality")), e["medium"])
    return {"ts": batch[0], "events": events, "data_parallel_rank": batch[2] if len(batch) > 2 else None}

"""Block keys: engine-independent chained hashes of token blocks, and namespaces.

A prompt is cut into full blocks of `block_tokens` tokens. Block i's hash is

    h_i = xxh3_128(h_{i-1} || tokens_i as little-endian uint32 || extra_i)

with h_{-1} = ROOT_HASH = xxh3_128(b"kvstore/v1/root"), a fixed seed: every
process on every host derives the same hashes for the same prefix, with no
shared state and no dependence on PYTHONHASHSEED. `extra_i` is empty unless the
request carries extra keys (LoRA adapter, cache_salt, multimodal items); they
are msgpack-encoded in a fixed order (see `ExtraKeys.encode_for_block`).
Because the hash chains, anything mixed into block 0 (cache_salt) separates the
whole chain.

A `Namespace` captures everything that makes KV bytes incompatible (model,
dtype, layer count, KV heads, head size, block tokens, layout, TP rank/size,
bytes per block). Two engines share a block exactly when namespace id and block
hash are equal.

`Namespace.tenant` keeps a TCP tenant's blocks apart from everyone else's: the
daemon stamps it from the session's authenticated tenant (kvstore/tokens.py says
why a cache_salt alone cannot). An empty tenant is the shared partition and is
left out of the id and of `to_dict`, so namespaces made before the field existed
keep their ids (and their blocks on disk).

`Namespace.anchor` ties a namespace's blocks to another's: the parent hash of a
block of an anchored namespace names a block of the anchor namespace, not its
own. A hybrid model's attachments use it (the sliding windows and recurrent
state at a prefix boundary hang under the full-attention block that ends
there, kvstore/connectors/hybrid.py), so the prefix tree holds a hybrid prefix
as one thing: an attachment is a leaf, evicted before the block it hangs under,
and never outlives it. Empty (no anchor) is left out of the id like `tenant`.

`Namespace.codec` is an engine's opt-in to lossy storage: it names the codec
profile (kvstore/codec_profile.py) whose compressed blocks the engine accepts.
Its blocks may be stored compressed in the tiers that compress
(`[compression]`); being in the id, they are never the blocks of the exact
namespace, so an engine that did not opt in never receives a lossy block.
Empty (exact only) is left out of the id like `tenant`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import NewType, Sequence

import msgpack
import numpy as np
import xxhash

BlockHash = NewType("BlockHash", bytes)

HASH_BYTES = 16
ROOT_HASH = BlockHash(xxhash.xxh3_128_digest(b"kvstore/v1/root"))

# A block's key in the store (`Key`): its namespace's tag then its hash, one bytes object. Ten million
# keys are ten million objects: a `(namespace id, hash)` tuple beside the hash's own bytes cost 64 B
# more a block. The tag stands for the namespace only inside one process; what leaves it (records,
# replies, events) names the namespace by its id (`key_ns`).
Key = bytes
TAG_BYTES = 8
_TAGS: dict[str, bytes] = {}  # namespace id -> its tag
_NAMES: dict[bytes, str] = {}  # tag -> namespace id
BLOCK_BYTES: dict[bytes, int] = {}  # tag -> its namespace's block size (written only by `note_block_bytes`)


def ns_tag(ns_id: str) -> bytes:
    """The 8 bytes that stand for namespace `ns_id` at the head of its blocks' keys (xxh3-64 of the id)."""
    tag = _TAGS.get(ns_id)
    if tag is None:
        if not isinstance(ns_id, str):
            raise TypeError(f"a namespace id is a string, not {type(ns_id).__name__}")
        tag = xxhash.xxh3_64_digest(ns_id.encode())
        if _NAMES.setdefault(tag, ns_id) != ns_id:
            raise ValueError(f"namespace ids {ns_id!r} and {_NAMES[tag]!r} have the same tag")
        _TAGS[ns_id] = tag
    return tag


def note_block_bytes(ns: "Namespace") -> None:
    """Remember the size of `ns`'s blocks under its tag in `BLOCK_BYTES` (a store does, registering a
    namespace), so a key tells its block's size and an index entry need not hold it. The size is part of
    the namespace's id, so a tag has one size."""
    BLOCK_BYTES[ns_tag(ns.id)] = ns.block_bytes


def block_key(ns_id: str, h: bytes) -> Key:
    """The store's key of block `h` of namespace `ns_id`."""
    return ns_tag(ns_id) + h


def key_ns(key: Key) -> str:
    """The namespace id of a store key."""
    return _NAMES[key[:TAG_BYTES]]


def key_hash(key: Key) -> bytes:
    """The block hash of a store key."""
    return key[TAG_BYTES:]


def key_text(key: Key) -> str:
    """A store key for people: `<namespace id>/<the hash's first 16 hex digits>`."""
    tag = bytes(key[:TAG_BYTES])
    return f"{_NAMES.get(tag, tag.hex())}/{bytes(key[TAG_BYTES:]).hex()[:16]}"


@dataclass(frozen=True, slots=True)
class MultimodalItem:
    """A multimodal input occupying prompt positions [offset, offset + length)."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """What makes the KV differ for the same tokens.

    lora: adapter name (applies to every block); cache_salt: tenant isolation
    (mixed into block 0 only, which separates the whole chain); mm: multimodal
    items, each mixed into the blocks it overlaps with its offset in the block.
    """

    lora: str | None = None
    cache_salt: str | None = None
    mm: tuple[MultimodalItem, ...] = ()

    def is_empty(self) -> bool:
        return self.lora is None and self.cache_salt is None and not self.mm

    def encode_for_block(self, index: int, block_tokens: int) -> bytes:
        parts: list = []
        if self.lora is not None:
            parts.append(("lora", self.lora))
        start, end = index * block_tokens, (index + 1) * block_tokens
        for item in self.mm:
            if item.offset < end and item.offset + item.length > start:
                parts.append(("mm", item.identifier, item.offset - start))
        if index == 0 and self.cache_salt is not None:
            parts.append(("cache_salt", self.cache_salt))
        return msgpack.packb(parts) if parts else b""


NO_EXTRA = ExtraKeys()


def lora_key(name: str, path: object = "") -> str:
    """The `ExtraKeys.lora` of a LoRA adapter (the vLLM connector's and `kvstore inspect`'s)."""
    return f"{name}@{path}"


def hash_blocks(
    token_ids: Sequence[int] | np.ndarray,
    block_tokens: int,
    extra: ExtraKeys = NO_EXTRA,
    parent: BlockHash = ROOT_HASH,
    start_block: int = 0,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block is ignored).

    `parent`/`start_block` continue a chain: hashing tokens[k*B:] with the hash of
    block k-1 and start_block=k gives the same hashes as hashing everything.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    arr = np.asarray(token_ids)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must be in [0, 2**32)")
    data = memoryview(arr.astype("<u4", copy=False).tobytes())
    num_blocks = len(arr) // block_tokens
    step = block_tokens * 4
    digest = xxhash.xxh3_128_digest
    out: list[BlockHash] = []
    h = parent
    if extra.is_empty():
        for i in range(num_blocks):
            h = digest(h + data[i * step : (i + 1) * step])
            out.append(h)
    else:
        for i in range(num_blocks):
            tail = extra.encode_for_block(start_block + i, block_tokens)
            h = digest(h + data[i * step : (i + 1) * step] + tail)
            out.append(h)
    return out  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class Namespace:
    """What makes KV bytes incompatible. `id` is a stable digest of all fields."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_tokens: int
    block_bytes: int
    layout: str = "LBHNC"
    tp_rank: int = 0
    tp_size: int = 1
    revision: str = ""
    tenant: str = ""  # "" = the shared partition; else a TCP tenant's own (see the module docstring)
    anchor: str = ""  # "" = parents are in this namespace; else the id of the namespace they are in
    codec: str = ""  # "" = exact bytes only; else the codec profile whose lossy blocks the engine accepts

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_tokens", "block_bytes", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"namespace field {name} must be a positive int, got {value!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"namespace tp_rank must be in [0, tp_size), got {self.tp_rank!r}")
        for name in ("model", "dtype", "layout", "revision", "tenant", "anchor", "codec"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"namespace field {name} must be a string")
        if not self.model or not self.dtype:
            raise ValueError("namespace model and dtype must be non-empty")
        if self.codec and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", self.codec):
            raise ValueError(f"namespace codec must name a codec profile ([A-Za-z0-9._-], 64 at most), got {self.codec!r}")

    @property
    def id(self) -> str:
        fields = sorted(self.to_dict().items())
        return "ns-" + xxhash.xxh3_64_hexdigest(msgpack.packb(fields))

    def to_dict(self) -> dict:
        fields = dataclasses.asdict(self)
        for name in ("tenant", "anchor", "codec"):
            if not fields[name]:
                del fields[name]  # ids and persisted records of namespaces without it stay as they were
        return fields

    @classmethod
    def from_dict(cls, data: dict) -> "Namespace":
        if not isinstance(data, dict):
            raise ValueError("namespace must be a map")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown namespace fields: {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as exc:  # missing fields
            raise ValueError(f"bad namespace: {exc}") from None

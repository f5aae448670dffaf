"""Where lossy storage applies: which blocks a tier stores compressed, with which codec profile.

A block is stored compressed in a tier exactly when
- the config compresses that tier (`[compression] disk = true`; off by default:
  it is lossy),
- its namespace opted in (`Namespace.codec` names a profile: a built-in
  uniform one such as `k4v3`, or `<profile_dir>/<name>.json`) and the codec can
  read its layout (kvstore/codec.py, `BlockLayout.from_namespace`), and
- it is not one of the first `sink_blocks` of its prefix (the attention sink).
Everything else is stored exact, as before.

Contracts with the tiers (which import nothing of kvstore): a tier that
compresses gets a `StoredCodec` with the block (`write_from(..., codec=)`):
its `stored_bytes` is what to allocate, `encode(payload)` gives those bytes
(called by the tier's own writer thread, off the event loop), `tag` is what to
record with the block. Decoding needs no profile (an encoded block describes
itself): `decode_into(blob, out)` expands a blob into host-memory views and
says False when it does not verify, which the tier reports as a failed
checksum, so a damaged block is a miss and never served.

A namespace that names a profile the daemon cannot find, or whose shape does
not fit it, is refused at registration (when a tier compresses), with the
reason.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvstore.codec import BlockLayout, CorruptBlock, decode, encode, encoded_bytes
from kvstore.codec_profile import Profile, uniform_profile
from kvstore.config import CompressionConfig
from kvstore.errors import NamespaceError
from kvstore.keys import Namespace

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class StoredCodec:
    """How one namespace's blocks are stored in a tier that compresses."""

    layout: BlockLayout
    profile: Profile

    @property
    def tag(self) -> str:
        return f"{self.profile.name}@{self.profile.digest}"

    @property
    def logical_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def stored_bytes(self) -> int:
        return encoded_bytes(self.layout, self.profile.budget)

    def encode(self, payload: np.ndarray) -> np.ndarray:
        return encode(payload, self.layout, self.profile.budget)


def decode_into(blob: np.ndarray, out: Sequence[np.ndarray]) -> bool:
    """Expand an encoded block into host-memory views `out` (in order); False, nothing written, when
    it does not verify or does not fill them exactly."""
    try:
        if len(out) == 1:
            decode(blob, None, out[0].reshape(-1))
            return True
        payload = decode(blob)
    except (CorruptBlock, ValueError):
        return False
    if payload.size != sum(o.size for o in out):
        return False
    pos = 0
    for o in out:
        o.reshape(-1)[:] = payload[pos : pos + o.size]
        pos += o.size
    return True


class Compression:
    """The daemon's compression settings, resolved per namespace (cached)."""

    def __init__(self, config: CompressionConfig) -> None:
        self.config = config
        self.tiers = {name for name, on in (("disk", config.disk), ("remote", config.remote)) if on}
        self._codecs: dict[str, StoredCodec | None] = {}

    def check_namespace(self, ns: Namespace) -> None:
        """Raise NamespaceError when `ns` opted into a profile this daemon cannot apply."""
        if ns.codec and self.tiers:
            self._resolve(ns)

    def codec(self, ns: Namespace) -> StoredCodec | None:
        if not ns.codec or not self.tiers:
            return None
        if ns.id not in self._codecs:
            try:
                self._codecs[ns.id] = self._resolve(ns)
            except NamespaceError as exc:  # a namespace recovered from disk whose profile went away
                log.warning("namespace %s is stored exact: %s", ns.id, exc)
                self._codecs[ns.id] = None
        return self._codecs[ns.id]

    def for_block(self, ns: Namespace, depth: int, tier: str) -> StoredCodec | None:
        """The codec `tier` stores this block with, or None (exact)."""
        if tier not in self.tiers:
            return None
        codec = self.codec(ns)
        if codec is None or depth < codec.profile.sink_blocks:
            return None
        return codec

    def _resolve(self, ns: Namespace) -> StoredCodec:
        layout = BlockLayout.from_namespace(ns)
        if layout is None:
            raise NamespaceError(f"namespace codec {ns.codec!r}: the codec cannot read layout {ns.layout!r} with "
                                 f"dtype {ns.dtype} and {ns.block_bytes} B blocks")
        try:
            profile = uniform_profile(ns.codec, layout) or self._load(ns.codec)
        except ValueError as exc:
            raise NamespaceError(f"namespace codec {ns.codec!r}: {exc}") from None
        if not profile.fits(layout):
            raise NamespaceError(f"codec profile {ns.codec!r} is for {profile.budget.bits.shape[:2]} (layers, KV "
                                 f"heads), the namespace has ({layout.num_layers}, {layout.num_kv_heads})")
        return StoredCodec(layout, profile)

    def _load(self, name: str) -> Profile:
        folder = self.config.profile_dir
        path = os.path.join(folder, f"{name}.json") if folder else ""
        if not path or not os.path.isfile(path):
            raise ValueError(f"no built-in profile of that name and no {name}.json in [compression] profile_dir "
                             f"({folder or 'not set'})")
        profile = Profile.load(path)
        if profile.name != name:
            raise ValueError(f"{path} holds profile {profile.name!r}")
        return profile

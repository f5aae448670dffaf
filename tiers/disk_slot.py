"""Where a disk block's bytes are: the disk tier's location of a block (`Entry.location` of a block in
the disk tier; tiers/disk.py). The disk tier holds most of a host's blocks, so its per-block state is
kept small. A location is one of:

- a plain int, `(offset << 32 | length) << 64 | checksum`: an exact block in one extent whose
  checksum is known when it is staged (a small block, hashed as it is copied) or recovered. Nearly
  every block of a disk of small blocks is one: 44 B, no object of its own (a `DiskSlot` and its
  packed int took 92). While its write is pending the tier keeps the write's job apart, by offset
  (`DiskTier._jobs`);
- a `DiskSlot` (an `EncodedSlot` for a block stored encoded): any other block, the job of its pending
  write in the slot. Its extents and checksum are a plain-int location too where they can be (one
  extent, the checksum known): one format of a location, whichever holds it.

`extents_of`, `checksum_of` and `codec_of` read either form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.tiers.disk_writer import DiskWrite

_MASK64 = (1 << 64) - 1
OFFSET_SHIFT = 96  # a plain-int location >> OFFSET_SHIFT: its offset in the data file


def settled(extents: list, checksum: int | None) -> int | None:
    """`extents` and `checksum` packed in one int: the plain-int location of an exact block (and what a
    `DiskSlot` keeps of an encoded one); None where they do not pack (several extents, a checksum not
    yet known or not 64 bits)."""
    if len(extents) == 1 and type(checksum) is int and 0 <= checksum <= _MASK64:
        offset, length = extents[0]
        if offset >= 0 and 0 <= length < 1 << 32:
            return (offset << 32 | length) << 64 | checksum
    return None


def _packed(extents: list, checksum: int | None) -> int | list:
    """A `DiskSlot`'s `_where`: `settled` where they pack, else `[extents, checksum]`."""
    where = settled(extents, checksum)
    return [extents, checksum] if where is None else where


def extents_of(location: "int | DiskSlot") -> list:
    """[[offset, length], ...] in the data file."""
    if type(location) is int:
        where = location >> 64
        return [[where >> 32, where & 0xFFFFFFFF]]
    return location.extents  # type: ignore[union-attr]


def checksum_of(location: "int | DiskSlot") -> int | None:
    """The xxh3-64 of the stored bytes; None while a `DiskSlot`'s write is pending."""
    return location & _MASK64 if type(location) is int else location.checksum  # type: ignore[union-attr]


def plain(location: object) -> int | None:
    """A disk location as a plain int where it is one or has one (an exact `DiskSlot` whose write has
    settled, with one extent): the two read the same (`extents_of`, `checksum_of`); else None."""
    if type(location) is int:
        return location
    if type(location) is DiskSlot and location.known_checksum() is not None and location.job is None:
        where = location._where
        return where if type(where) is int else None
    return None


def codec_of(location: object, default: object = None) -> object:
    """The tag of the codec a disk location's bytes are encoded with (None: exact); `default` for a
    location of another tier (no codec)."""
    return None if type(location) is int else getattr(location, "codec", default)


class DiskSlot:
    """Where a disk block's bytes are. While `job` is not done, they are also in its staging buffer.

    The disk tier holds most of a host's blocks, so a slot is small (it was 140 B a block as an object
    of five fields with two ints of their own; [[offset, length]] lists before that, 168 B more):
    - where its location can be a plain int (one extent, its checksum known: `settled`), the slot
      keeps that int; otherwise (several extents, or a write still pending) `[extents, checksum]`;
    - an exact block keeps no codec and no size of its own (the class's None and 0: its size is its
      Entry's); a block stored encoded is an `EncodedSlot`, which does."""

    __slots__ = ("_where", "job")
    codec: str | None = None  # the tag of the codec the bytes are encoded with (EncodedSlot); None: exact
    logical: int = 0  # an encoded block's own size, decoded (EncodedSlot); 0 for an exact block

    def __new__(cls, extents: list, checksum: int | None, job: DiskWrite | None = None, codec: str | None = None,
                logical: int = 0) -> "DiskSlot":
        return object.__new__(EncodedSlot if codec is not None else cls)

    def __init__(self, extents: list, checksum: int | None, job: DiskWrite | None = None, codec: str | None = None,
                 logical: int = 0) -> None:
        """`codec`: the tag of the codec its bytes are encoded with (None: exact); `logical`: an encoded
        block's own size (decoded)."""
        self._where = _packed(extents, checksum)
        self.job = job
        if codec is not None:
            self.codec, self.logical = codec, logical

    @property
    def extents(self) -> list:
        """[[offset, length], ...] in the data file (a new list for a block in one extent)."""
        where = self._where
        return extents_of(where) if type(where) is int else where[0]

    @property
    def checksum(self) -> int | None:
        """The xxh3-64 of the stored bytes; None while the write is pending."""
        where = self._where
        return checksum_of(where) if type(where) is int else where[1]

    @checksum.setter
    def checksum(self, value: int | None) -> None:
        self._where = _packed(self.extents, value)  # (not a 64-bit checksum: kept, and it will not verify)

    def __repr__(self) -> str:
        return f"DiskSlot({self.extents}, {self.checksum}, codec={self.codec})"

    @staticmethod
    def recovered(extents: list, checksum: int, codec: str | None, logical: int) -> "int | DiskSlot":
        """The location of a block the index holds: a plain int where it can be one."""
        where = settled(extents, checksum) if codec is None else None
        return DiskSlot(extents, checksum, None, codec, logical) if where is None else where

    def known_checksum(self) -> int | None:
        if self.checksum is None and self.job is not None and self.job.done and self.job.error is None:
            self.checksum, self.job = self.job.checksum, None
        return self.checksum


class EncodedSlot(DiskSlot):
    """A disk block stored encoded: a `DiskSlot` with its codec's tag and its decoded size."""

    __slots__ = ("codec", "logical")

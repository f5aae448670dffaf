"""A hybrid model's KV as the store keeps it: what each KV cache group needs for a hit, and where it is stored.

vLLM's hybrid KV cache manager (HMA) gives every kind of layer its own KV cache group, block table and
block ids. For a prefix hit of N tokens (a multiple of the block size B) every group must be restored at
N, each in its own way:

- **full** (full attention, MLA): every block of [0, N);
- **window** (sliding window, chunked-local attention): the blocks its window reaches back from N
  (vLLM gives the others its shared null block, and frees them as a prompt moves on);
- **state** (Mamba, linear attention, short convolutions, vLLM's "align" mode): the recurrent state at
  exactly N, one block at index N/B - 1, which vLLM offers at the boundaries it keeps
  (`boundary_state_offloads`, valid only in the step that offers it).

The store keeps a hybrid prefix as a *spine* and *attachments*:

- the spine: one stored block per block position, chained like a dense model's blocks (key h_i, parent
  h_{i-1}), holding the pages of every full group at that position. A model without a full group keeps
  its window groups' pages here, at every position (the window is then read from the spine's last
  blocks).
- an attachment at a kept boundary N: one block holding what the other groups need to resume at N —
  each window group's last `window_blocks` pages before N and each state group's page at N — in a
  namespace anchored to the spine's (kvstore/keys.py, `Namespace.anchor`): key h_{N/B-1}, parent the
  spine block of that same hash. The store's prefix tree then holds the prefix as one thing: an
  attachment is a leaf, evicted before its spine block, and useless without it.

Boundaries are kept where vLLM offers a state (models with state groups), else at the prompt's last
full block boundaries and every `boundary_interval` tokens: a hybrid prefix stores its full groups'
bytes and one window per kept boundary, not every group's every block.

Both sides of the connector build the same `HybridLayout` from the same KV cache config: the scheduler
plans lookups, loads and saves with it; the workers cut stored blocks into pages with it. A group kind
the store cannot serve makes `layout_from_config` raise ValueError with the reason: the connector then
offers no hits for that model (it never fails the engine, and HMA stays on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvstore.connectors.copy_plan import EMPTY_PLAN, CopyPlan, KVGeometry, build_plan

FULL, WINDOW, STATE = "full", "window", "state"
SPINE, ATTACHMENT = 0, 1  # the two stored block kinds of a hybrid prefix (index into a rank's namespaces)


@dataclass(frozen=True)
class GroupPlan:
    """One vLLM KV cache group as the store keeps it."""

    group: int  # vLLM's group index
    kind: str  # FULL, WINDOW or STATE
    layers: tuple[str, ...]
    page_bytes: int  # one block of this group: its layers' unpadded pages, in layer order
    reach: int = 0  # WINDOW: tokens before the next one that it attends to (sliding window - 1 + retained)
    chunk: int = 0  # WINDOW: a chunked-local group's chunk size (attends within its chunk)

    def first_needed(self, n_tokens: int, block_tokens: int) -> int:
        """The first block a hit at `n_tokens` needs (vLLM's `get_num_skipped_tokens`, in blocks)."""
        if self.kind == FULL:
            return 0
        if self.kind == STATE:
            return n_tokens // block_tokens - 1
        skipped = (n_tokens // self.chunk) * self.chunk if self.chunk else max(0, n_tokens - self.reach)
        return skipped // block_tokens

    def window_blocks(self, block_tokens: int) -> int:
        """The most blocks before a boundary this group needs."""
        if self.kind == STATE:
            return 1
        if self.kind == WINDOW:
            return -(-(self.chunk or self.reach) // block_tokens)
        raise ValueError("a full group needs every block")


@dataclass(frozen=True)
class Segment:
    """A page of one group inside a stored block: `nbytes` at `offset`, for the group's block at position
    `rel` (spine: the stored block's own position; attachment: relative to the boundary's block N/B)."""

    group: int  # index into HybridLayout.groups
    rel: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class HybridLayout:
    block_tokens: int
    groups: tuple[GroupPlan, ...]
    spine: tuple[Segment, ...]
    attachment: tuple[Segment, ...]  # empty: the spine alone serves a hit
    boundary_interval: int  # tokens between kept boundaries (without state groups)

    @property
    def spine_bytes(self) -> int:
        return sum(s.nbytes for s in self.spine)

    @property
    def attachment_bytes(self) -> int:
        return sum(s.nbytes for s in self.attachment)

    @property
    def has_state(self) -> bool:
        return any(g.kind == STATE for g in self.groups)

    @property
    def spine_kind(self) -> str:
        return self.groups[self.spine[0].group].kind

    @property
    def window_spine(self) -> int:
        """Blocks before a hit's end that a window spine needs (0: the spine is full, every block)."""
        if self.spine_kind != WINDOW:
            return 0
        return max(self.groups[s.group].window_blocks(self.block_tokens) for s in self.spine)

    def describe(self) -> str:
        """What the namespace digest must cover: kinds, windows, block size, layers and page bytes."""
        parts = [f"B{self.block_tokens}"]
        for g in self.groups:
            extra = f"r{g.reach}" if g.reach else f"c{g.chunk}" if g.chunk else ""
            parts.append(f"{g.kind}{extra}:{g.page_bytes}:{','.join(g.layers)}")
        return ";".join(parts)

    def kept_boundaries(self, start: int, end: int, prompt_tokens: int) -> list[int]:
        """Boundaries (in blocks) in (start, end] where a model without state groups keeps an attachment:
        every `boundary_interval` tokens, and the prompt's last full block boundaries (the one an identical
        prompt can hit, and the one a longer prompt that extends it can)."""
        bt = self.block_tokens
        every = max(self.boundary_interval // bt, 1)
        marks = {prompt_tokens // bt, (prompt_tokens - 1) // bt}
        return [j for j in range(start + 1, end + 1) if j % every == 0 or j in marks]


def layout_from_groups(specs: Sequence[tuple[int, Any, Sequence[str]]], boundary_interval: int = 0) -> HybridLayout:
    """The layout of KV cache groups given as (group index, vLLM KVCacheSpec, layer names).

    Raises ValueError naming a group the store cannot serve (then the connector offers no hits)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    sizes = {spec.block_size for _, spec, _ in specs}
    if len(sizes) != 1:
        raise ValueError(f"KV cache groups of different block sizes {sorted(sizes)}")
    bt = sizes.pop()
    groups = []
    for index, spec, layers in specs:
        kind_name = type(spec).__name__
        if not getattr(spec, "prefix_cacheable", True):
            raise ValueError(f"KV cache group {index} ({kind_name}) is not prefix-cacheable")
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align":
                raise ValueError(f"KV cache group {index}: Mamba cache mode {spec.mamba_cache_mode!r} "
                                 f"(the store keeps states of 'align' mode, vLLM's mode with prefix caching)")
            groups.append(GroupPlan(index, STATE, tuple(layers), spec.real_page_size_bytes * len(layers)))
        elif isinstance(spec, SlidingWindowSpec):
            reach = spec.sliding_window - 1 + getattr(spec, "extra_retained_tokens", 0)
            groups.append(GroupPlan(index, WINDOW, tuple(layers), spec.real_page_size_bytes * len(layers), reach=reach))
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            groups.append(GroupPlan(index, WINDOW, tuple(layers), spec.real_page_size_bytes * len(layers),
                                    chunk=spec.attention_chunk_size))
        elif isinstance(spec, FullAttentionSpec) and kind_name not in ("RSWASpec", "HiddenStateCacheSpec"):
            groups.append(GroupPlan(index, FULL, tuple(layers), spec.real_page_size_bytes * len(layers)))
        else:
            raise ValueError(f"KV cache group {index}: {kind_name} is not a kind the store keeps")
    return build_layout(tuple(groups), bt, boundary_interval)


def build_layout(groups: tuple[GroupPlan, ...], block_tokens: int, boundary_interval: int = 0) -> HybridLayout:
    """Spine and attachment segments for `groups` (see the module docstring)."""
    full = [i for i, g in enumerate(groups) if g.kind == FULL]
    windows = [i for i, g in enumerate(groups) if g.kind == WINDOW]
    states = [i for i, g in enumerate(groups) if g.kind == STATE]
    spine_groups = full or windows
    if not spine_groups:
        raise ValueError("no attention group: a model of recurrent state only is not kept")
    spine, offset = [], 0
    for i in spine_groups:
        spine.append(Segment(i, 0, offset, groups[i].page_bytes))
        offset += groups[i].page_bytes
    attachment, offset = [], 0
    for i in (windows if full else []) + states:
        g = groups[i]
        w = g.window_blocks(block_tokens)
        for k in range(w):
            attachment.append(Segment(i, k - w, offset, g.page_bytes))
            offset += g.page_bytes
    if not boundary_interval:  # four windows apart (a window's bytes per four blocks' worth), at least 16 blocks
        widest = max((groups[i].window_blocks(block_tokens) for i in windows), default=1)
        boundary_interval = max(4 * widest, 16) * block_tokens
    boundary_interval = -(-boundary_interval // block_tokens) * block_tokens  # whole blocks (vLLM may pick the size)
    return HybridLayout(block_tokens, groups, tuple(spine), tuple(attachment), boundary_interval)


# -- the engine block ids of a stored block's segments --------------------------------------------------------
def spine_ids(layout: HybridLayout, block_ids: Sequence[Sequence[int]], pos: int) -> list[int] | None:
    """The engine blocks of the spine block at `pos` (block_ids: vLLM's per-group lists); None where one
    is missing or vLLM's null block (a position the engine no longer holds)."""
    out = []
    for s in layout.spine:
        ids = block_ids[layout.groups[s.group].group]
        if pos >= len(ids) or ids[pos] == 0:
            return None
        out.append(ids[pos])
    return out


def attachment_ids(layout: HybridLayout, block_ids: Sequence[Sequence[int]], end: int, first: int = 0,
                   state_ids: dict[int, int] | None = None) -> list[int] | None:
    """The engine blocks of the attachment at boundary `end` (in blocks): per segment the block id, or -1
    for a page not to copy (before `first`, the first block position to touch, or before the group's
    window). `state_ids`: vLLM group -> the block its boundary offer names (saves); else the block at
    end - 1 (loads). None where a needed page has no engine block."""
    bt = layout.block_tokens
    out = []
    for s in layout.attachment:
        g = layout.groups[s.group]
        pos = end + s.rel
        if pos < max(first, g.first_needed(end * bt, bt)):
            out.append(-1)
            continue
        if g.kind == STATE and state_ids is not None:
            block = state_ids.get(g.group, 0)
        else:
            ids = block_ids[g.group]
            block = ids[pos] if pos < len(ids) else 0
        if block == 0:
            return None
        out.append(block)
    return out


# -- copy plans for composite blocks ----------------------------------------------------------------------------
def slice_extents(extents: Sequence[Sequence[int]], start: int, length: int) -> list[list[int]]:
    """The [offset, length] runs of bytes [start, start + length) of a block stored at `extents`."""
    out, pos, end = [], 0, start + length
    for off, n in extents:
        lo, hi = max(start, pos), min(end, pos + n)
        if lo < hi:
            out.append([off + lo - pos, hi - lo])
        pos += n
        if pos >= end:
            break
    if sum(n for _, n in out) != length:
        raise ValueError(f"extents of {pos} B do not hold bytes [{start}, {end})")
    return out


def composite_plan(geometries: Sequence[KVGeometry], segments: Sequence[Segment], block_ids: Sequence[Sequence[int]],
                   extents: Sequence, to_kv: bool) -> CopyPlan:
    """The plan that moves stored blocks made of `segments` (block b at `extents[b]`, absolute addresses;
    its segment k to or from engine block `block_ids[b][k]` of its group, or nowhere where -1) between the
    store and the engine's KV. `geometries[g]`: the KV geometry of layout group g."""
    per_group: dict[int, tuple[list, list]] = {}
    for ids, ext in zip(block_ids, extents):
        for seg, block in zip(segments, ids):
            if block < 0:
                continue
            want = per_group.setdefault(seg.group, ([], []))
            want[0].append(block)
            want[1].append(slice_extents(ext, seg.offset, seg.nbytes))
    plans = [build_plan(geometries[g], ids, exts, 0, to_kv) for g, (ids, exts) in per_group.items()]
    plans = [p for p in plans if len(p)]
    if not plans:
        return EMPTY_PLAN
    if len(plans) == 1:
        return plans[0]
    return CopyPlan(*(np.concatenate([getattr(p, f) for p in plans]) for f in ("src", "dst", "size", "layer")))

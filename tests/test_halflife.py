"""eviction/halflife.py: the attention policy's half-life follows the expert whose miniature cache hit most."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys

import pytest

from kvstore.eviction.attention import AttentionParams, AttentionPolicy
from kvstore.eviction.base import BlockInfo
from kvstore.eviction.ghosts import MAX_GHOSTS
from kvstore.eviction.halflife import HALF_LIVES_S, HalfLifeExperts, mixed, sampled
from kvstore.tools.bench.policy_sim import load, simulate

KEYS = [b"\x00" * 8, b"block-hash-0123", ("ns", b"\x17" * 32), "a", 12345, ("ns", "k7")]


def test_the_sample_is_about_one_key_in_eight_and_the_same_in_every_process():
    rng = random.Random(1)
    keys = [rng.randbytes(32) for _ in range(20000)]
    share = sum(map(sampled, keys)) / len(keys)
    assert 0.115 < share < 0.135  # 1/8 = 0.125; binomial sd 0.0023
    assert sum(sampled(("ns", k)) for k in keys[:2000]) == sum(map(sampled, keys[:2000]))  # store keys: the hash
    assert len({i % 8 for i in range(8000) if sampled(i)}) == 8  # sequential trace ids are mixed, not taken modulo 8
    here = [sampled(k) for k in KEYS]
    code = ("import sys; sys.path.insert(0, '.'); from kvstore.eviction.halflife import sampled; "
            f"print([sampled(k) for k in {KEYS!r}])")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        assert out.strip() == str(here)


def test_each_expert_keeps_its_own_clock():
    ex = HalfLifeExperts(insert_credit=0.5, hit_credit=1.0, ghost_credit=1.0, ghost_factor=4.0)
    assert ex.half_life_s == max(HALF_LIVES_S) == 2000.0  # it starts with the longest memory
    assert ex.advance(100.0) == [0.0, 0.0, 0.0]  # the clocks start at the first event
    assert ex.advance(4100.0) == pytest.approx([4000 / 30, 4000 / 240, 2.0])  # in half-lives of each
    assert ex.advance(4000.0) == pytest.approx([4000 / 30, 4000 / 240, 2.0])  # a clock that steps back: no move


def _chain_policy(experts_order: list[float]):
    """A policy over 60 blocks: 20 hit often long ago, 20 hit once recently, 20 inserted last."""
    t = [0.0]
    p = AttentionPolicy(lambda: t[0])
    keys = [bytes([i]) * 8 for i in range(60)]
    for k in keys[:20]:
        p.on_insert(BlockInfo(k, None, 0, 100, 16))
    for _ in range(5):
        t[0] += 10
        p.on_access(keys[:20])
    t[0] += 600
    for k in keys[20:40]:
        p.on_insert(BlockInfo(k, None, 0, 100, 16))
    p.on_access(keys[20:40])
    t[0] += 5
    for k in keys[40:]:
        p.on_insert(BlockInfo(k, None, 0, 100, 16))
    orders = []
    for h in experts_order:
        p.experts.lead = HALF_LIVES_S.index(h)  # what a decision does
        p._follow()
        orders.append(p.victims(20 * 100, lambda k: True))
    return keys, p, orders


def test_a_switch_re_keys_the_tier_exactly_and_back():
    """Frequent-but-old blocks go first under 30 s, recent single ones under 2000 s; switching back
    restores the first order exactly (every block keeps its value under every expert)."""
    keys, p, (short, long, short_again) = _chain_policy([30.0, 2000.0, 30.0])
    assert set(short) == set(keys[:20])  # 5 hits 615 s ago: ~2^-20 of a hit now, at 30 s
    assert set(long) == set(keys[40:])  # at 2000 s the old counts still stand; the newest single inserts go
    assert short_again == short and p.rekeys == 3
    assert p.half_life_s == 30.0 and p.depth_weight == p.params.depth_weight
    p.experts.lead = HALF_LIVES_S.index(2000.0)
    p._follow()
    assert p.depth_weight == 0.0  # no depth term under the longest memory


def test_the_lead_changes_only_on_a_difference_beyond_two_standard_deviations():
    """Experts that disagree on 100 references (weight 1 each) differ by noise of sd 10: 15 hits
    ahead is not enough to take the lead, 25 is; ties and a lead already held change nothing."""
    ex = HalfLifeExperts(insert_credit=0.5, hit_credit=1.0, ghost_credit=1.0, ghost_factor=4.0)
    lead, other = ex.lead, HALF_LIVES_S.index(30.0)
    ex._apart[lead][other] = ex._apart[other][lead] = 100.0
    ex.minis[lead].hits, ex.minis[other].hits = 100.0, 115.0
    ex._decide()
    assert ex.lead == lead and ex.switches == 0
    ex.minis[other].hits = 125.0
    ex._decide()
    assert ex.lead == other and ex.switches == 1 and ex.half_life_s == 30.0


def test_bad_experts_are_refused():
    kw = dict(insert_credit=0.5, hit_credit=1.0, ghost_credit=1.0, ghost_factor=4.0)
    with pytest.raises(ValueError, match="positive and finite"):
        HalfLifeExperts((30.0, float("inf")), 30.0, **kw)
    with pytest.raises(ValueError, match="must be one of"):
        HalfLifeExperts((30.0, 240.0), 100.0, **kw)
    with pytest.raises(ValueError, match="not one of the experts"):
        AttentionParams(half_life_s=100.0)
    assert AttentionParams(half_life_s=100.0, adapt=False).half_life_s == 100.0  # fixed: any positive value


@pytest.mark.parametrize("shape, leader, gain", [("gen:agentic", 30.0, 0.05), ("gen:scan", 2000.0, 0.01)])
def test_the_policy_moves_to_the_half_life_the_workload_wants_and_hits_more(shape, leader, gain):
    """Agent loops reuse a context seconds after writing it (a short memory wins); documents queried at
    random reward a long one. The fixed 240 s policy (adapt=False) is the negative control."""
    reqs = load(shape)
    made: list[AttentionPolicy] = []
    adaptive = simulate(reqs, lambda clock: made.append(AttentionPolicy(clock)) or made[-1], 4000)
    fixed = simulate(reqs, lambda clock: AttentionPolicy(clock, AttentionParams(adapt=False)), 4000)
    experts = made[0].experts
    assert experts is not None and made[0].half_life_s == leader
    assert experts.led[HALF_LIVES_S.index(leader)] > 0.8 * sum(experts.led)  # it settles instead of flapping
    assert adaptive["hit_ratio"] > fixed["hit_ratio"] + gain, (adaptive["hit_ratio"], fixed["hit_ratio"])


def test_only_sampled_keys_cost_expert_state_and_the_miniatures_hold_what_the_tier_holds():
    t = [0.0]
    p = AttentionPolicy(lambda: t[0])
    ex = p.experts
    rng = random.Random(2)
    keys = [rng.randbytes(16) for _ in range(4000)]
    for i, k in enumerate(keys):
        t[0] = i * 0.1
        if i >= 500:
            p.on_remove(keys[i - 500])  # 500 resident
        p.on_insert(BlockInfo(k, None, 0, 100, 16))
    last = next(k for k in (rng.randbytes(16) for _ in range(1000)) if sampled(k))
    p.on_remove(keys[-500])
    p.on_insert(BlockInfo(last, None, 0, 100, 16))  # a sampled reference: the miniatures follow the tier's size
    held = {k for k in keys[-499:] + [last] if sampled(k)}
    assert ex._held == held and 40 < len(held) < 90  # ~500 / 8
    for m in ex.minis:  # every key referenced once: a miniature of the tier's size holds the newest ones
        assert set(m.values) == held  # the oldest (most decayed) went first, as they left the tier
        assert len(m.ghost) <= 16 * len(held) and not any(k in m.ghost for k in m.values)
        assert m.hits == 0  # nothing was referenced twice


def test_a_miniature_scores_a_hit_only_for_a_key_it_still_holds():
    """The expert's score is its miniature's hits: a key re-referenced within the expert's capacity hits,
    beyond it misses; a key back from the ghost table resumes its count (a longer memory keeps it)."""
    from kvstore.eviction.halflife import MiniCache

    m = MiniCache(30.0, (0.5, 1.0, 1.0), ghost_factor=4.0)
    assert m.reference("a", 2, 1.0) is False and m.reference("b", 2, 1.0) is False
    assert m.reference("a", 2, 1.0) is True and m.hits == 1.0  # held: a hit; a's count is now 1.5
    assert m.reference("c", 2, 1.0) is False  # full: b (0.5, older than c) goes, a (1.5) stays
    assert set(m.values) == {"a", "c"} and len(m.ghost) == 1 and "b" in m.ghost
    m.tau += 10  # ten half-lives later every count has decayed by 1024
    assert m.reference("b", 2, 1.0) is False and set(m.values) == {"a", "b"}  # back from the ghost; c (lowest) goes
    assert m.reference("c", 2, 1.0) is False and set(m.values) == {"b", "c"}  # b resumed 0.5/1024 + 1 > a's 1.5/1024
    assert m.hits == 1.0 and len(m.ghost) == 1 and "a" in m.ghost


def test_the_early_miniatures_are_heard_only_while_the_full_size_ones_have_no_evidence():
    """The same experts at half the tier's size evict before the tier does. A clear lead among them
    (2.5 sd) moves the lead while the full-size miniatures have fewer than EARLY_EVIDENCE disagreements
    with the leader; with more, only the full-size ones decide. early_fraction=0: no early miniatures."""
    from kvstore.eviction.halflife import EARLY_EVIDENCE

    ex = HalfLifeExperts(insert_credit=0.5, hit_credit=1.0, ghost_credit=1.0, ghost_factor=4.0)
    lead, other = ex.lead, HALF_LIVES_S.index(30.0)
    assert len(ex.early) == len(ex.minis) and ex.early_fraction == 0.5
    ex._apart_early[lead][other] = ex._apart_early[other][lead] = 100.0
    ex.early[lead].hits, ex.early[other].hits = 100.0, 125.0
    ex._apart[lead][other] = ex._apart[other][lead] = EARLY_EVIDENCE  # a tie at full size, with evidence
    ex._decide()
    assert ex.lead == lead and ex.switches == 0
    ex._apart[lead][other] = ex._apart[other][lead] = EARLY_EVIDENCE - 1  # too little to go on
    ex._decide()
    assert ex.lead == other and ex.switches == ex.early_switches == 1
    off = HalfLifeExperts(insert_credit=0.5, hit_credit=1.0, ghost_credit=1.0, ghost_factor=4.0, early_fraction=0)
    assert off.early == []
    with pytest.raises(ValueError, match="early_fraction"):
        AttentionParams(early_fraction=1.0)


def test_early_evidence_follows_a_hot_set_that_moves_and_keeps_a_scan_on_frequency():
    """Shift at 16k blocks: the tier first evicts after the hot set moved; the early miniatures have
    seen the move by then, so the lead leaves 2000 s sooner (negative control: early_fraction=0, the
    session-9 policy, which lost this cell to LRU). Scan at 16k: they change nothing that costs."""
    def run(shape, **kw):
        made: list[AttentionPolicy] = []
        res = simulate(load(shape), lambda clock: made.append(AttentionPolicy(clock, AttentionParams(**kw)))
                       or made[-1], 16000)
        return res["hit_ratio"], made[0].experts

    early, ex = run("gen:shift")
    late, _ = run("gen:shift", early_fraction=0.0)
    lru = simulate(load("gen:shift"), "lru", 16000)["hit_ratio"]
    assert ex.early_switches > 0 and early > late + 0.002 and early >= lru, (early, late, lru)
    scan, _ = run("gen:scan")
    scan_late, _ = run("gen:scan", early_fraction=0.0)
    assert scan >= scan_late, (scan, scan_late)


def test_past_max_sampled_keys_the_experts_follow_the_keys_of_smallest_mix():
    """Fixed-size sampling: once the tier holds more sampled keys than `max_sampled`, the experts let go
    of the held keys of the largest mix and follow only keys mixing below them: they hold the
    `max_sampled` resident keys of smallest mix, and their miniatures no resident key past them."""
    t = [0.0]
    p = AttentionPolicy(lambda: t[0], params=AttentionParams(max_sampled=40))
    ex = p.experts
    rng = random.Random(7)
    keys = [("ns", rng.randbytes(16)) for _ in range(6000)]
    resident = set()
    for i, k in enumerate(keys):
        t[0] = i * 0.01
        p.on_insert(BlockInfo(k, None, 0, 100, 16))
        resident.add(k)
        if i % 3 == 2:  # a third leaves again: the experts' record of who has the largest mix goes stale
            gone = keys[rng.randrange(i + 1)]
            if gone in resident:
                p.on_remove(gone)
                resident.discard(gone)
        if i % 100 == 99:
            p.on_access([k for k in keys[i - 50 : i] if k in resident])
    followed = sorted((k for k in resident if sampled(k)), key=mixed)
    assert len(followed) > 200  # the tier holds several times the sample
    assert ex._held == set(followed[: len(ex._held)]) and 30 < len(ex._held) <= 40
    assert all(mixed(k) >= ex._below for k in followed[len(ex._held):])
    for m in ex.minis + ex.early:  # (a miniature may still hold keys the tier let go, until it evicts them)
        assert len(m.values) <= 40 and all(mixed(k) < ex._below for k in m.values if k in resident)
    assert len(ex._by_mix) <= 2 * 40 + 64 + 1
    # the miniatures' history is capped at the share of the policy's cap their keys now are
    assert all(m._ghost_most == MAX_GHOSTS * ex._below / 2**64 < MAX_GHOSTS / 8 for m in ex.minis + ex.early)
    more = (("more", i.to_bytes(16, "little")) for i in itertools.count())
    for k in list(itertools.islice((k for k in more if mixed(k) < ex._below), 400)):  # followed keys come and go at the sample's size:
        p.on_insert(BlockInfo(k, None, 0, 100, 16))              # what the experts keep of them stays bounded
        p.on_remove(k)
    assert len(ex._held) <= 40 and len(ex._by_mix) <= 2 * 40 + 64 + 1
    assert HalfLifeExperts(insert_credit=0.5, hit_credit=1.0, ghost_credit=1.0, ghost_factor=4.0)._by_mix is None
    with pytest.raises(ValueError):
        AttentionParams(max_sampled=0)

"""The chaos run's capture plan (tools/bench/chaos_run.py, `capture_plan`): the fresh prefills that give
the stored-bytes oracle its reference KV, one per sequence, none that is a prefix of another."""

from __future__ import annotations

from kvstore.tools.bench.chaos_run import capture_plan

BS = 4


def test_a_capture_that_is_a_prefix_of_another_is_left_out_and_its_blocks_read_from_the_longer():
    system = list(range(100, 108))  # two blocks
    turn1 = system + [1, 2, 3, 4, 5]  # its third block not full
    turn2 = system + [1, 2, 3, 4, 9, 9, 9, 9, 7]  # extends turn 1's full blocks
    other = system + [50, 51, 52, 53]
    blocks = [(turn1, 0), (turn1, 2), (turn2, 1), (turn2, 3), (other, 2), (other, 1)]
    captures, where = capture_plan(blocks, BS)
    assert sorted(map(len, captures)) == [12, 16]  # turn 1's 12 tokens are turn 2's first 12
    for (seq, depth), (j, d) in zip(blocks, where):
        assert d == depth
        assert captures[j][: (depth + 1) * BS] == seq[: (depth + 1) * BS]


def test_without_shared_prefixes_every_sequence_has_its_capture_up_to_its_deepest_block():
    a, b = list(range(12)), list(range(20, 32))
    captures, where = capture_plan([(a, 0), (b, 1), (a, 1)], BS)
    assert captures == [a[:8], b[:8]]
    assert where == [(0, 0), (1, 1), (0, 1)]

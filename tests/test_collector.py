"""The daemon's settings of CPython's cyclic collector (server/daemon.py `tune_gc`, `YoungCollections`,
`GcPauses`): in this process, with the settings undone after each test."""

from __future__ import annotations


def test_tune_gc_freezes_what_survives_a_young_collection_and_runs_no_other():
    """A full collection walks every block's objects with the loop stopped (seconds at 10^7 blocks), a
    middle one the survivors of ten young ones: after tune_gc, objects that survive young collections are
    frozen and start no other collection; cyclic garbage that dies young still goes; GcPauses counts and
    times the collections that run; untune_gc undoes it all."""
    import gc

    from kvstore.server.daemon import GcPauses, tune_gc, untune_gc

    threshold = gc.get_threshold()
    pauses = GcPauses()
    tune_gc()
    gc.callbacks.append(pauses)
    try:
        frozen = gc.get_freeze_count()
        middle, full = (gc.get_stats()[g]["collections"] for g in (1, 2))
        kept = [[i] for i in range(3_000_000)]  # 150 young collections' worth, every object surviving
        assert [gc.get_stats()[g]["collections"] for g in (1, 2)] == [middle, full]
        assert pauses.count[0] >= 100 and pauses.count[1] == pauses.count[2] == 0
        assert gc.get_freeze_count() >= frozen + 2_900_000  # (frozen young collection by young collection)
        gc.collect(0)  # (the last lists join the frozen objects)
        frozen, freed = gc.get_freeze_count(), gc.get_stats()[0]["collected"]
        for _ in range(200_000):  # garbage cycles dying young: young collections free them, none is frozen
            a: list = []
            a.append(a)
        assert gc.get_stats()[0]["collected"] - freed > 150_000
        assert gc.get_freeze_count() - frozen < 1_000
        gc.collect()  # (one asked for still runs)
        assert pauses.count[2] == 1 and pauses.longest_s[2] > 0 and pauses.stats()[2]["collections"] == 1
        del kept
    finally:
        gc.callbacks.remove(pauses)
        untune_gc(threshold)
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0


def test_young_collections_run_on_the_loops_clock_while_old_objects_die_as_new_ones_are_made():
    """A daemon replacing its blocks frees an old object for each new one: CPython's count (allocations
    less deallocations) stays under its threshold while the young generation grows without bound, until
    one collection walks it all with the loop stopped. YoungCollections collects on the loop's clock
    instead, so the young generation holds what a few milliseconds allocated; cancel() stops it."""
    import asyncio
    import gc

    from kvstore.server.daemon import GcPauses, YoungCollections, tune_gc, untune_gc

    threshold = gc.get_threshold()
    tune_gc()
    old = [[i] for i in range(400_000)]
    gc.collect(0)  # (they are frozen: the daemon's blocks)
    pauses = GcPauses()
    gc.callbacks.append(pauses)

    async def replace(young: YoungCollections | None) -> int:
        """Replace the old objects one for one, a slice per turn of the loop; the largest young
        generation seen."""
        most = 0
        for i in range(0, len(old), 20_000):
            for j in range(i, i + 20_000):
                old[j] = [j]  # (a new object, an old one freed: the count does not move)
            most = max(most, len(gc.get_objects(0)))
            await asyncio.sleep(0.003)
        if young is not None:
            young.cancel()
        return most

    async def run(every_s: float | None) -> int:
        young = YoungCollections(asyncio.get_running_loop(), every_s) if every_s else None
        return await replace(young)

    try:
        piled_up = asyncio.run(run(None))
        gc.collect(0)  # (the new objects join the frozen ones: the next run starts as this one did)
        collections = pauses.count[0]
        bounded = asyncio.run(run(0.01))
        assert pauses.count[0] - collections >= 3
        assert piled_up >= 390_000, "CPython's own threshold let the young generation grow (the control)"
        assert bounded <= 200_000, f"collected on the loop's clock, it stayed small: {bounded}"
        after = pauses.count[0]

        async def idle() -> None:
            young = YoungCollections(asyncio.get_running_loop(), 0.005)
            young.cancel()
            await asyncio.sleep(0.05)

        asyncio.run(idle())
        assert pauses.count[0] == after, "no collection after cancel()"
    finally:
        gc.callbacks.remove(pauses)
        untune_gc(threshold)

"""The scheduler side's pins of planned loads, held until the workers say the step's loads are done.

Both scheduler sides (dense, vllm_scheduler.py; hybrid, hybrid_scheduler.py) pin what a lookup found so that
it stays stored until the workers pin it themselves. A step's pins are released once every worker reported
that step's loads (`WorkerReport.loads_done`), or `PIN_TTL_STEPS` steps later at the latest: a worker pins
what it copies itself, so an early release costs a possible recompute, never wrong bytes. A worker that
reports its side disabled (its KV could not be mapped) stops the scheduler side from offering hits.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Generic, TypeVar

from kvstore.connectors.vllm_meta import WorkerReport

log = logging.getLogger(__name__)

PIN_TTL_STEPS = 16
P = TypeVar("P")


class StepPins(Generic[P]):
    def __init__(self, num_workers: int, release: Callable[[P], None]) -> None:
        self.num_workers = num_workers
        self._release = release
        self.pending: list[P] = []  # pinned for loads planned in the step being built
        self._by_step: dict[int, list[P]] = {}
        self._done: Counter = Counter()
        self.workers_disabled = False

    def close_step(self, step: int) -> None:
        """The step's metadata is built: its loads' pins wait for the workers' reports."""
        if self.pending:
            self._by_step[step] = self.pending
        self.pending = []
        for old in [s for s in self._by_step if s < step - PIN_TTL_STEPS]:
            self._done.pop(old, None)
            for pins in self._by_step.pop(old):
                self._release(pins)

    def report(self, report: object) -> None:
        """A step's worker reports (aggregated by vLLM): release the pins of steps every worker finished."""
        if not isinstance(report, WorkerReport):
            return
        if report.disabled and not self.workers_disabled:
            log.warning("kvstore: a worker's side of the connector is disabled (see its log): no more hits offered")
            self.workers_disabled = True
        for step, n in report.loads_done.items():
            self._done[step] += n
            if self._done[step] >= self.num_workers:
                del self._done[step]
                for pins in self._by_step.pop(step, []):
                    self._release(pins)

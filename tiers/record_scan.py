"""A persistent tier's block records, read at open in a thread of their own (the disk's and the host arena's).

A tier that keeps millions of blocks takes seconds to read their records (a
msgpack record per block, checked one by one): the daemon serves meanwhile,
and the store adopts the blocks once they are read (kvstore/recovery.py).
`RecordScan` is the thread and its hand-over; a tier's subclass reads its own
records (`_scan`, over one LMDB snapshot) into its result. Until the tier has
taken that result it knows no free page and so takes no block: no write can
land on a page that a record it has not read yet points at.
"""

from __future__ import annotations

import threading
import time
from typing import Generic, Iterator, TypeVar

import lmdb

YIELD_EVERY = 256  # records between two releases of the GIL (the event loop waits for it meanwhile)

R = TypeVar("R")


class RecordScan(Generic[R]):
    """One background read of the records of `db` in `env`; `result()` once it is done."""

    def __init__(self, env: lmdb.Environment, db: object, thread_name: str) -> None:
        self._env, self._db = env, db
        self._result: R | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def result(self, wait: bool = False) -> R | None:
        """The scan's result once it is done (None before, unless `wait`); re-raises its error."""
        if wait:
            self._done.wait()
        elif not self._done.is_set():
            return None
        if self._error is not None:
            raise self._error
        return self._result

    def stop(self) -> None:
        """Abandon the scan (the tier closes before it was done) and wait for its thread."""
        self._stopping = True
        self._thread.join()

    def _run(self) -> None:
        try:
            self._result = self._scan()
        except BaseException as exc:  # handed to the owner with the result
            self._error = exc
        finally:
            self._done.set()

    def _records(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, bytes]]:
        """(record key, record) of every record in key order, releasing the GIL every YIELD_EVERY; ends
        early when the scan is stopped."""
        for i, item in enumerate(txn.cursor(db=self._db)):
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                if self._stopping:
                    return
                time.sleep(0)
            yield item

    def _scan(self) -> R:
        raise NotImplementedError

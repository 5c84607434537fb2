"""Notice a worker that dies the moment it dies, as torch's SIGCHLD handler does.

torch installs a SIGCHLD handler in the main process that raises as soon as a worker exits
unexpectedly. This loader does not take over a process-wide signal: a thread of the
iterator waits on the workers' process sentinels (multiprocessing's public handle that
becomes ready when a process ends) and, when one fires, puts a WorkerExited marker on the
results queue, so a main thread waiting for a batch wakes at once and raises torch's error
(multiprocess_iterator.py). A main thread busy elsewhere learns of it at its next batch, as
it would from any result; the 0.5 s status poll stays as a second line.
"""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import wait


class WorkerExited:
    """Queue marker: some worker process ended; the iterator checks which, and whether it should have."""

    def __reduce__(self):
        return WorkerExited, ()


class WorkerWatch:
    def __init__(self, workers, results):
        self.workers, self.results = workers, results
        self.wake_read, self.wake_write = os.pipe()  # written at stop: ends the wait
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="prescient-worker-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pending = {worker.sentinel: worker for worker in self.workers if worker.pid is not None}
        try:
            while pending and not self.stopped:
                ready = wait([*pending, self.wake_read])
                if self.stopped or self.wake_read in ready:
                    return
                for sentinel in ready:
                    pending.pop(sentinel, None)
                self.results.put((None, WorkerExited()))
        except (OSError, ValueError):  # the queue or a handle closed under us at shutdown
            pass

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        try:
            os.write(self.wake_write, b"x")
        except OSError:
            pass
        self.thread.join(timeout=1)
        for fd in (self.wake_read, self.wake_write):
            try:
                os.close(fd)
            except OSError:
                pass

"""num_workers > 0: worker processes (worker_loop.py) fetch batches; this iterator hands them
indices and yields their results in the sampler's order (or as they come, in_order=False).

Task t (the t-th index drawn this epoch) goes to the next live worker round robin, starting
at worker `rotation` (a resumed run that starts at batch k rotates by k % num_workers, so
batch b is still fetched by worker b % num_workers, with that worker's RNG stream). At most
prefetch_factor * num_workers tasks are out at once; each result taken sends the next index.
A result's tensors come through the iterator's result rings (result_rings.py), rebuilt as the
result is taken from the queue (by the pin thread, when pinning). A worker that dies wakes a
waiting next() at once (worker_watch.py), as torch's SIGCHLD handler does.

Failures are reported as torch reports them: an exception in a worker is raised again here
with the worker's traceback (worker_loop.WorkerError); `timeout` > 0 bounds each wait for a
result; a worker that dies (a signal, os._exit) is noticed at the next result asked for, or
at once while next() waits (worker_watch.py; STATUS_SECONDS polls as a second line), and
raised as RuntimeError("DataLoader worker (pid(s) ...) exited unexpectedly"), from the cause
torch's SIGCHLD handler would give ("... is killed by signal: Killed. "). Shutdown (end of
epoch for non-persistent workers, the iterator dropped, close(), interpreter exit): the done
event is set, each worker gets None and is joined, one still alive after STATUS_SECONDS is
terminated; workers are daemonic, and each also exits by itself when its parent process is
gone.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import signal
import time
import warnings
import weakref
from pickle import PicklingError

import torch
import torch.multiprocessing

from loader.workers.iterator import LoaderIterator
from loader.workers.loop import NewEpoch, WorkerDone, WorkerError, worker_loop
from loader.workers.pin_memory import PinThread
from loader.workers.result_rings import Receiver, ResultRings, Shipped
from loader.workers.watch import WorkerExited, WorkerWatch

STATUS_SECONDS = 0.5  # how often a wait for results checks that the workers live (torch: 5 s, with SIGCHLD)
_exiting = False  # set at interpreter exit: multiprocessing then terminates daemonic workers itself
_persistent = weakref.WeakSet()  # iterators with persistent workers and a pin thread, stopped at exit


def _at_exit() -> None:
    global _exiting
    for iterator in list(_persistent):
        iterator.shutdown()
    _exiting = True


atexit.register(_at_exit)


class MultiProcessIterator(LoaderIterator):
    def __init__(self, loader, dataset, index_sampler, engine, rotation: int = 0, ring_sets=None):
        super().__init__(loader, dataset, index_sampler, engine)
        self.prefetch_factor = loader.prefetch_factor
        self.in_order = loader.in_order
        self.persistent = loader.persistent_workers
        self.rotation = rotation
        context = loader.multiprocessing_context or torch.multiprocessing
        self.results = context.Queue()
        self.done_event = context.Event()
        self.index_queues, self.workers = [], []
        self.shut = False
        self.result_rings = ResultRings.for_iterator(self.num_workers)  # batches' tensors (result_rings.py)
        self.receiver = Receiver(self.result_rings) if self.result_rings is not None else None
        # the fill rings this iterator's workers write (fill_ring.py): (RingSets, the set), or None
        ring_set = ring_sets.claim() if ring_sets is not None else None
        self.fill_rings = (ring_sets, ring_set) if ring_set is not None else None
        rings = ring_sets.rings(ring_set, self.num_workers) if self.fill_rings else [None] * self.num_workers
        try:
            for worker_id in range(self.num_workers):
                index_queue = context.Queue()
                index_queue.cancel_join_thread()
                worker = context.Process(
                    target=worker_loop,
                    args=(
                        self.iterable,
                        dataset,
                        index_queue,
                        self.results,
                        self.done_event,
                        self.auto_collation,
                        self.collate_fn,
                        self.drop_last,
                        self.base_seed,
                        loader.worker_init_fn,
                        worker_id,
                        self.num_workers,
                        rings[worker_id],
                        self.result_rings,
                    ),
                    daemon=True,
                )
                self.index_queues.append(index_queue)
                self.workers.append(worker)
                worker.start()
        except (TypeError, AttributeError, PicklingError):
            self.shutdown()
            warnings.warn(  # torch's words: spawn/forkserver pickle the dataset and the functions
                "Got pickle error when attempting to start a worker Process. "
                "This might be because the worker Process arguments are not picklable. "
                "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
                "to 'forkserver', which requires the worker Process arguments to be picklable. "
                "You can also try multiprocessing.set_start_method('fork').",
                stacklevel=4,
            )
            raise
        except BaseException:
            self.shutdown()
            raise
        # a dying worker wakes a waiting next(): the watch puts a marker on the results queue from this
        # process, whose feeder thread must then not be waited for at exit (the workers, started
        # already, keep theirs)
        self.results.cancel_join_thread()
        self.watch = WorkerWatch(self.workers, self.results)
        self.pinner = None
        if self.pin_device is not None:
            self.pinner = PinThread(self.results, torch.accelerator.current_device_index(), self.receiver)
            if self.persistent:
                _persistent.add(self)
        self.data = self.pinner.out if self.pinner is not None else self.results
        self._start_epoch()

    # --- epochs ---------------------------------------------------------------------------------
    def _start_epoch(self) -> None:
        self.sent = self.received = 0  # tasks sent to workers / next task to return in order
        self.tasks: dict[int, tuple] = {}  # task -> (worker,) while out, (worker, data) once back early
        self.outstanding = 0
        self.alive = [True] * self.num_workers  # still given tasks this epoch
        self.per_worker = [0] * self.num_workers
        order = range(self.num_workers)
        self.cycle = itertools.islice(itertools.cycle(order), self.rotation % max(1, self.num_workers), None)
        self.rotation = 0
        for _ in range(self.prefetch_factor * self.num_workers):
            self._send_next()

    def restart(self, loader) -> None:
        super().restart(loader)
        self.alive = [True] * self.num_workers
        pending = self.num_workers
        for index_queue in self.index_queues:
            index_queue.put(NewEpoch())
        while pending:  # results of the last epoch still in flight are dropped
            task, _ = self._get()
            if isinstance(task, NewEpoch):
                pending -= 1
        self._start_epoch()

    # --- tasks ----------------------------------------------------------------------------------
    def _send_next(self) -> None:
        try:
            index = next(self.sampler_iter)
        except StopIteration:
            return
        limit = self.prefetch_factor * self.num_workers
        for _ in range(self.num_workers):
            worker = next(self.cycle)
            if self.alive[worker] and (self.in_order or self.per_worker[worker] < limit // sum(self.alive)):
                break
        else:
            return
        self.index_queues[worker].put((self.sent, index))
        self.tasks[self.sent] = (worker,)
        self.per_worker[worker] += 1
        self.outstanding += 1
        self.sent += 1

    def next_batch(self):
        while True:
            while self.received < self.sent:
                info = self.tasks.get(self.received)
                if info and (len(info) == 2 or self.alive[info[0]]):
                    break  # arrived, or its worker will still deliver it
                self.tasks.pop(self.received, None)  # an IterableDataset worker that ended
                self.received += 1
            else:
                if not self.persistent:
                    self.shutdown()
                raise StopIteration
            if len(self.tasks[self.received]) == 2:
                worker, data = self.tasks.pop(self.received)
                self.received += 1
                return self._deliver(data, worker)
            task, data = self._get()
            self.outstanding -= 1
            if isinstance(data, WorkerDone):
                self.alive[data.worker_id] = False
                if not self.persistent:
                    self.index_queues[data.worker_id].put(None)
                self._send_next()
                continue
            if task == self.received or not self.in_order:
                worker = self.tasks.pop(task)[0]
                if task == self.received:
                    self.received += 1
                return self._deliver(data, worker)
            self.tasks[task] += (data,)

    def _deliver(self, data, worker: int):
        self.per_worker[worker] -= 1
        self._send_next()
        if isinstance(data, WorkerError):
            data.reraise()
        return data

    def _get(self):
        """The next (task, data) from any worker; raises as torch does on a timeout or a dead worker."""
        self._check_workers()  # torch learns of a dead worker at once (SIGCHLD); so does this, per result
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else None
        while True:
            wait = STATUS_SECONDS if deadline is None else min(STATUS_SECONDS, deadline - time.monotonic())
            try:
                task, data = self.data.get(timeout=max(wait, 0.001))
            except queue.Empty:
                pass
            else:
                if type(data) is WorkerExited:
                    self._check_workers()  # raises for a worker that died; a clean exit waits on
                    continue
                if type(data) is Shipped:
                    data = self.receiver.unpack(data)
                return task, data
            self._check_workers()
            if self.pinner is not None and not self.pinner.thread.is_alive():
                raise RuntimeError("Pin memory thread exited unexpectedly")
            if deadline is not None and time.monotonic() >= deadline:
                raise RuntimeError(f"DataLoader timed out after {self.timeout} seconds")

    def _check_workers(self) -> None:
        dead = [
            (w, worker) for w, worker in enumerate(self.workers) if self.alive[w] and not worker.is_alive()
        ]
        if not dead:
            return
        for w, _ in dead:
            self.alive[w] = False
        first = dead[0][1]
        if first.exitcode is not None and first.exitcode < 0:
            name = signal.strsignal(-first.exitcode) or f"signal {-first.exitcode}"
            cause = RuntimeError(f"DataLoader worker (pid {first.pid}) is killed by signal: {name}. ")
        else:
            cause = RuntimeError(
                f"DataLoader worker (pid {first.pid}) exited unexpectedly with exit code {first.exitcode}. "
                "Details are lost due to multiprocessing. Rerunning with num_workers=0 may give better "
                "error trace."
            )
        pids = ", ".join(str(worker.pid) for _, worker in dead)
        raise RuntimeError(f"DataLoader worker (pid(s) {pids}) exited unexpectedly") from cause

    # --- shutdown -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self.__dict__.get("shut", True) or _exiting:
            return
        self.shut = True
        try:
            if getattr(self, "watch", None) is not None:
                self.watch.stop()  # before the workers are told to stop: their exit is no news
            if getattr(self, "pinner", None) is not None:
                self.pinner.stop()
                self.results.cancel_join_thread()
                self.results.close()
            self.done_event.set()
            for index_queue, worker in zip(self.index_queues, self.workers):
                if worker.pid is not None:
                    index_queue.put(None)
            for worker in self.workers:
                if worker.pid is not None:
                    worker.join(timeout=STATUS_SECONDS)
            for index_queue in self.index_queues:
                index_queue.cancel_join_thread()
                index_queue.close()
        finally:
            stopped = True
            for worker in self.workers:
                if worker.pid is not None and worker.is_alive():
                    worker.terminate()
                    worker.join(timeout=STATUS_SECONDS)
                    stopped = stopped and not worker.is_alive()
            if self.fill_rings is not None and stopped:  # no worker of ours can write the rings now
                self.fill_rings[0].release(self.fill_rings[1])
                self.fill_rings = None
            if getattr(self, "result_rings", None) is not None:
                self.result_rings.close()

    def __del__(self) -> None:
        self.shutdown()

    # --- torch's names (see LoaderIterator) -----------------------------------------------------
    _workers = property(lambda self: self.workers)  # the worker processes (multiprocessing.Process)
    _index_queues = property(lambda self: self.index_queues)  # one per worker: the indices it fetches
    _worker_result_queue = property(lambda self: self.results)  # what the workers put their batches on
    _data_queue = property(lambda self: self.data)  # where next() takes batches (the pin thread's, pinning)
    _workers_done_event = property(lambda self: self.done_event)
    _workers_status = property(lambda self: self.alive)  # per worker: still given tasks this epoch
    _shutdown = property(lambda self: self.__dict__.get("shut", True))  # workers told to stop (or never up)
    _persistent_workers = property(lambda self: self.persistent)
    _prefetch_factor = property(lambda self: self.prefetch_factor)
    _send_idx = property(lambda self: self.sent)  # tasks sent this epoch
    _rcvd_idx = property(lambda self: self.received)  # the next task to yield in order
    _tasks_outstanding = property(lambda self: self.outstanding)

    @property
    def _pin_memory_thread(self):
        """The pinning thread; absent without pin_memory, as in torch (code tests hasattr)."""
        if getattr(self, "pinner", None) is None:
            raise AttributeError("_pin_memory_thread")
        return self.pinner.thread

    def _shutdown_workers(self) -> None:
        self.shutdown()

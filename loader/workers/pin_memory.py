"""pin_memory=True as torch does it: batches are copied into page-locked memory of the current
accelerator, by a thread of the main process when there are workers (so the copy overlaps the
training step), inline otherwise. Without an accelerator torch warns once per iterator and
pins nothing; so does this loader (`pin_device` returns None).
"""

from __future__ import annotations

import collections.abc
import copy
import queue
import threading
import warnings

import torch

from loader.workers.loop import WorkerError
from loader.workers.result_rings import Shipped

POLL_SECONDS = 1.0  # how often the pin thread looks at its stop flag while it waits


def pin_device(pin_memory: bool, pin_memory_device: str) -> str | None:
    """The accelerator type batches are pinned for, or None; warns as torch's iterator does."""
    if pin_memory and pin_memory_device:
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the device,"
            f"ignore pin_memory_device='{pin_memory_device}'.",
            stacklevel=4,
        )
    if not pin_memory:
        return None
    if not torch.accelerator.is_available():
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, "
            "then device pinned memory won't be used.",
            stacklevel=4,
        )
        return None
    device = torch.accelerator.current_accelerator().type
    if device == "mps":  # torch cannot pin for MPS yet and says so
        warnings.warn(
            "'pin_memory' argument is set as true but not supported on MPS now, "
            "device pinned memory won't be used.",
            stacklevel=4,
        )
        return None
    return device


def pin(data):
    """`data` with every tensor (and every object with a pin_memory() method) in pinned memory;
    containers keep their type, as in torch."""
    if isinstance(data, torch.Tensor) or hasattr(data, "pin_memory"):
        return data.pin_memory()
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.Mapping):
        pinned = {key: pin(value) for key, value in data.items()}
        try:
            if isinstance(data, collections.abc.MutableMapping):
                clone = copy.copy(data)
                clone.update(pinned)
                return clone
            return type(data)(pinned)
        except TypeError:
            return pinned
    if isinstance(data, tuple):
        items = [pin(item) for item in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if isinstance(data, collections.abc.Sequence):
        items = [pin(item) for item in data]
        try:
            if isinstance(data, collections.abc.MutableSequence):
                clone = copy.copy(data)
                for i, item in enumerate(items):
                    clone[i] = item
                return clone
            return type(data)(items)
        except TypeError:
            return items
    return data


class PinThread:
    """Takes (task, batch) from the workers' result queue, pins the batch, puts it on `out`."""

    def __init__(self, source, device_index: int, receiver=None):
        self.source, self.out = source, queue.Queue()
        self.receiver = receiver  # rebuilds batches sent through the result rings (result_rings.py)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(device_index,), daemon=True)
        self.thread.start()

    def _run(self, device_index: int) -> None:
        torch.set_num_threads(1)
        torch.accelerator.set_device_index(device_index)
        while not self.done.is_set():
            try:
                task, data = self.source.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if type(data) is Shipped:
                try:
                    data = self.receiver.unpack(data)
                except Exception:
                    data = WorkerError(f"in pin memory thread for device {device_index}")
            if not self.done.is_set() and not isinstance(data, WorkerError):
                try:
                    data = pin(data)
                except Exception:
                    data = WorkerError(f"in pin memory thread for device {device_index}")
            self.out.put((task, data))

    def stop(self) -> None:
        self.done.set()
        self.source.put((None, None))  # wakes the thread if it waits on an empty queue
        self.thread.join()

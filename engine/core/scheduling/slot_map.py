"""The slot map of one group (torch-free): which request owns which slot, epochs, and
which slots get a row in the next batch. The scheduler decides with it alone; the
runner's `Group` adds the device storage behind the same slots.

`requests[slot]` is the owner (None: free); `epoch[slot]` increments on every release,
so a report tagged (slot, epoch) from before a release is recognised as stale.
"""
from __future__ import annotations

import numpy as np


class SlotMap:
    def __init__(self, key: tuple, latent_shape: tuple[int, int, int], slots: int):
        self.key = key
        self.latent_shape = latent_shape
        self.slots = slots
        self.requests: list = [None] * slots
        self.epoch = np.zeros(slots, dtype=np.int64)
        self.runnable = np.zeros(slots, dtype=bool)  # gets a row in the next batch
        self.step_index = np.zeros(slots, dtype=np.int64)  # steps launched: the one place a slot's step lives
        self.last_fence: list = [None] * slots  # fence of the last launch that touched the slot
        self.last_served = 0  # batch counter at its last batch (or its creation), for fairness

    @property
    def busy(self) -> np.ndarray:
        """Owned by a request (running, finishing or draining)."""
        return np.fromiter((r is not None for r in self.requests), dtype=bool, count=self.slots)

    @property
    def active(self) -> int:
        return sum(r is not None for r in self.requests)

    def free_slot(self) -> int:
        for slot, request in enumerate(self.requests):
            if request is None:
                return slot
        return -1

    def place(self, request, slot: int, step: int = 0) -> None:
        """`step`: where a parked request resumes (0 for a new one)."""
        self.requests[slot] = request
        self.runnable[slot] = True
        self.step_index[slot] = step
        request.group, request.slot = self, slot

    def release(self, slot: int) -> None:
        """After the fence of the slot's last launch: nothing reads its storage any more."""
        self.requests[slot].steps_at_release = int(self.step_index[slot])
        self.requests[slot] = None
        self.runnable[slot] = False
        self.last_fence[slot] = None
        self.epoch[slot] += 1

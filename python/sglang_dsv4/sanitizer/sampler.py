"""The one sampling decision: whether a forward batch is read-checked.

Two hooks ask it about the same batch: the decode CUDA graph runner's can_run_graph (a sampled
step must run eagerly, so nothing is checked inside a captured region) and the attention
backend's init_forward_metadata (an eager step, graphs off or not possible). Whichever asks first
draws; the other gets the same answer for that batch. Only decode batches are ever sampled.
"""

from __future__ import annotations

import random
import weakref


class Sampler:
    def __init__(self, rate: float, rng: random.Random):
        self.rate = rate
        self.rng = rng
        self._batch = None  # a weak reference to the batch decided last (or the batch itself)
        self.sampled = False
        self.decided = 0  # batches drawn for
        self.chosen = 0  # of which sampled

    def _is_current(self, batch) -> bool:
        held = self._batch
        if isinstance(held, weakref.ref):
            return held() is batch
        return held is batch

    def decide(self, batch) -> tuple[bool, bool]:
        """(sampled, new): the batch's decision, drawn on the first call for it."""
        if self._batch is not None and self._is_current(batch):
            return self.sampled, False
        try:
            self._batch = weakref.ref(batch)
        except TypeError:  # an object that takes no weak reference: held until the next batch
            self._batch = batch
        mode = getattr(batch, "forward_mode", None)
        decode = mode is not None and mode.is_decode()
        self.sampled = decode and self.rng.random() < self.rate
        self.decided += 1
        self.chosen += self.sampled
        return self.sampled, True

    def current(self, batch) -> bool:
        """Whether `batch` is the batch being checked now."""
        return self.sampled and self._batch is not None and self._is_current(batch)

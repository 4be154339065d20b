"""Live tensor bytes on a rank, and their peak, counted at the dispatcher (works on CPU).

`PeakTracker` is a dispatch mode: every storage an op allocates is added
when it appears and removed when it is freed (a weakref finalizer on the
storage). Storages alive when tracking starts (parameters, optimizer state)
are counted once as the baseline, so `peak` is the whole rank's peak of
tensor memory during the tracked region, as an allocator would see it
(without its caching and rounding).
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(obj) -> list:
    out = []
    for t in tree_flatten(obj)[0]:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if torch.is_tensor(t) and not t.is_meta or (torch.is_tensor(t) and t.is_meta):
            try:
                out.append(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                continue
    return out


class PeakTracker(TorchDispatchMode):
    """Track live storage bytes; `baseline(tensors)` counts what already exists."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        self._refs: list = []

    def _add(self, storage) -> None:
        key = storage.data_ptr() if not storage.device.type == "meta" else id(storage)
        if key in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(key)
        n = storage.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        self._refs.append(weakref.finalize(storage, self._free, key, n))

    def _free(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n

    def baseline(self, tensors) -> None:
        """Count tensors that exist before tracking (parameters, gradients, optimizer state)."""
        for s in _storages(list(tensors)):
            self._add(s)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for s in _storages(out):
            self._add(s)
        return out

    def reset_peak(self) -> None:
        self.peak = self.live

    def ignore(self, tensors) -> None:
        """Never count these storages (their bytes are accounted for another way)."""
        for st in _storages(list(tensors)):
            self._seen.add(st.data_ptr() if st.device.type != "meta" else id(st))
            self._refs.append(st)  # keep the id valid while tracking

    def account(self, nbytes: int) -> None:
        """Count memory that is not a tracked tensor (+ allocated, - freed), e.g. in a dry run."""
        self.live += nbytes
        self.peak = max(self.peak, self.live)

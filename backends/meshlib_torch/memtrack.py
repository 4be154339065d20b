"""Live tensor bytes on a rank, and their peak, counted at the dispatcher (works on CPU).

`PeakTracker` is a dispatch mode: every storage an op allocates is added
when it appears and removed when it is freed (a weakref finalizer on the
storage). Storages alive when tracking starts (parameters, optimizer state)
are counted once as the baseline, so `peak` is the whole rank's peak of
tensor memory during the tracked region, as an allocator would see it
(without its caching and rounding). FSDP2 frees and re-allocates its
gathered parameters by resizing their storages in place, which no op
dispatch shows, so `UntypedStorage.resize_` is watched too while tracking.
"""

from __future__ import annotations

import weakref

import torch

from .torch_private import TorchDispatchMode, local_tensor, pytree


def _storages(obj) -> list:
    out = []
    for t in pytree.tree_flatten(obj)[0]:
        t = local_tensor(t)
        if torch.is_tensor(t):
            try:
                out.append(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                continue
    return out


class PeakTracker(TorchDispatchMode):
    """Track live storage bytes; `baseline(tensors)` counts what already exists. `device` ("cpu",
    "cuda") counts only storages there: a rank's real memory, leaving out the meta tensors a model
    built on the meta device computes with (a dry run counts those on purpose)."""

    def __init__(self, device: str | None = None):
        super().__init__()
        self.device = device
        self.live = 0
        self.peak = 0
        self._bytes: dict[int, int] = {}  # id(storage) -> bytes counted for it now
        self.label = None  # what storages made from now on are made by (`live_by_label`)
        self._labels: dict[int, object] = {}
        self._ignored: list = []
        self._resize = None

    def _add(self, storage) -> None:
        key = id(storage)
        if key in self._bytes or storage.nbytes() == 0:
            return
        if self.device is not None and storage.device.type != self.device:
            return
        self._bytes[key] = storage.nbytes()
        if self.label is not None:
            self._labels[key] = self.label
        self._grow(storage.nbytes())
        weakref.finalize(storage, self._free, key)

    def _grow(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self._bytes.pop(key, 0)
        self._labels.pop(key, None)

    def live_by_label(self) -> dict:
        """Bytes alive now, by the `label` that was set when they were made (storages made with none set,
        and those alive before tracking, are left out): for instance what each layer's forward keeps."""
        out: dict = {}
        for key, label in self._labels.items():
            out[label] = out.get(label, 0) + self._bytes.get(key, 0)
        return out

    def _resized(self, storage, new: int) -> None:
        key = id(storage)
        if key in self._bytes:
            old = self._bytes[key]
            self._bytes[key] = new
            self._grow(new - old)
        elif new:
            self._add(storage)

    def baseline(self, tensors) -> None:
        """Count tensors that exist before tracking (parameters, gradients, optimizer state)."""
        for s in _storages(list(tensors)):
            self._add(s)

    def ignore(self, tensors) -> None:
        """Never count these storages (their bytes are accounted for another way)."""
        for st in _storages(list(tensors)):
            self._bytes.setdefault(id(st), 0)
            self._ignored.append(st)  # keeps the id valid while tracking

    def account(self, nbytes: int) -> None:
        """Count memory that is not a tracked tensor (+ allocated, - freed), e.g. in a dry run."""
        self._grow(nbytes)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __enter__(self):
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            out = original(storage, size)
            tracker._resized(storage, storage.nbytes())
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for s in _storages(out):
            self._add(s)
        return out

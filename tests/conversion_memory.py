"""How much of a checkpoint the converter holds at once: every tensor it reads from the HF files, or
builds from them while reading (an FP8 weight dequantized with its block scales, one MXFP4 expert cut
out of a fused tensor and dequantized), is followed by a weak reference, and at each read the bytes of
those still alive are added up (each storage once). A converter that gathered a layer's or a rank's
tensors before writing them would hold many at once; streaming holds a few, whatever the model's size.

    resident = ResidentReads.following(monkeypatch)
    hf_to_megatron(...)
    assert_bounded_by_a_tensor(resident)
"""

from __future__ import annotations

import threading
import weakref

from toolkit.convert.fp8 import Fp8View
from toolkit.convert.fused_experts import FusedExpertsView
from toolkit.convert.hf_source import HFCheckpoint
from toolkit.convert.to_megatron import FILE_THREADS

# The readers a conversion goes through: the files, and the views that dequantize on reading
READERS = (HFCheckpoint, Fp8View, FusedExpertsView)


class ResidentReads:
    def __init__(self):
        self._alive: list[weakref.ref] = []
        self._lock = threading.Lock()
        self._depth = threading.local()  # reads within a read: a view reading the files
        self.peak = 0  # the most bytes read and still alive at the start of a read
        self.largest = 0  # the largest tensor the converter reads (from the outermost view), in bytes as read
        self.model = 0  # all of them
        self.reads = 0

    @classmethod
    def following(cls, monkeypatch) -> "ResidentReads":
        resident = cls()
        for reader in READERS:
            monkeypatch.setattr(reader, "read", resident._tracked(reader.read))
        return resident

    def _tracked(self, read):
        def tracked(view, name, *args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            self._note(view if depth == 0 else None)
            self._depth.n = depth + 1
            try:
                tensor = read(view, name, *args, **kwargs)
            finally:
                self._depth.n = depth
            with self._lock:
                self._alive.append(weakref.ref(tensor))
                self.reads += 1
            return tensor

        return tracked

    def _note(self, outermost) -> None:
        with self._lock:
            if outermost is not None:
                self.largest = max(self.largest, max(e.nbytes for e in outermost.tensors.values()))
                self.model = max(self.model, sum(e.nbytes for e in outermost.tensors.values()))
            storages = {}
            for ref in self._alive:
                if (t := ref()) is not None:
                    storage = t.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
            self._alive = [ref for ref in self._alive if ref() is not None]
            self.peak = max(self.peak, sum(storages.values()))


def assert_bounded_by_a_tensor(resident: ResidentReads) -> None:
    """At most a tensor's worth per rank file being written (FILE_THREADS at once), on a model large
    enough next to that bound for a converter that gathers to exceed it."""
    assert resident.reads, "nothing was read"
    bound = FILE_THREADS * resident.largest
    assert resident.model > 4 * bound, (resident.model, bound)
    assert resident.peak <= bound, (resident.peak, resident.largest)

"""Host copies of a run's state for checkpoints and elastic commits: every tensor copied into host
memory that stays mapped and is reused from one copy to the next (no fresh allocation, so no page
faults on the training thread). The memory is a memfd that the checkpoint writer process
(train/checkpoint.py, Writer) maps too, and `Layout` lays a copy out as torch.save's file with the
tensors' data left where it lies, so that process writes the file without torch. Without memfd (not
Linux), copies are fresh CPU tensors.
"""
import mmap
import os
import sys
import threading

import numpy
import torch

try:
    from torch.utils.serialization import config as _serialization_config
except ImportError:  # (an older torch: its files always carry checksums)
    _serialization_config = None


def host_copy(value):
    """The state as it is now, in host memory: every tensor copied (CPU tensors too, since a
    state_dict's tensors are the live weights), so training can go on while another process or thread
    writes it. Dicts, lists and tuples are copied around them; other values are kept as they are.

    The copies live in a shared host-memory arena that is reused once no tensor of an earlier copy is
    alive (a checkpoint's copy is alive until its write is done; a copy someone keeps, such as an
    elastic commit, keeps its arena). Without memfd (not Linux), they are fresh CPU tensors."""
    tensors = _tensors_with_data(value)
    places, size = [], 0
    for tensor in tensors:
        places.append(size)
        size += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    lent = HOST_MEMORY.lend(size) if tensors else None
    if lent is None:
        return replace_tensors(value, lambda t: t.detach().to("cpu", copy=True))
    copies = {}
    with torch.no_grad():  # (one tensor object made per tensor: each made is work for Python's collector)
        for tensor, place in zip(tensors, places):
            copy = torch.frombuffer(lent, dtype=tensor.dtype, count=tensor.numel(), offset=place)
            copy.as_strided_(tensor.shape, _dense_strides(tensor))
            copy.copy_(tensor)
            copies[id(tensor)] = copy
    del lent  # (the copies hold it: the arena is busy while any of them lives)
    return replace_tensors(value, lambda t: copies.get(id(t)) if id(t) in copies else t.detach().to("cpu", copy=True))


_ALIGN = 64  # bytes: where each tensor of a host copy starts in its arena


def reserve(state) -> None:
    """Pages in now the host memory that host copies of `state` will use (a copy made and let go: its
    arena stays for the next), so that the first checkpoint's copy costs the training step what the
    later ones do rather than ~0.07 s of page faults (ResNet-50)."""
    host_copy(state)


def _tensors_with_data(value) -> list[torch.Tensor]:
    """The tensors of a state, each once, leaving out the empty ones (nothing to copy or write)."""
    found = {}
    _collect(value, found)
    return [t for t in found.values() if t.numel()]


def _collect(value, found: dict) -> None:
    if isinstance(value, torch.Tensor):
        found[id(value)] = value
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, found)


def replace_tensors(value, tensor_to):
    """`value` with each tensor t replaced by tensor_to(t), its dicts, lists and tuples rebuilt."""
    if isinstance(value, torch.Tensor):
        return tensor_to(value)
    if isinstance(value, dict):
        return {key: replace_tensors(item, tensor_to) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(replace_tensors(item, tensor_to) for item in value)
    return value


def _dense_strides(tensor: torch.Tensor) -> tuple:
    """The strides of a dense copy in the tensor's own layout (channels_last stays channels_last), as
    `.to(copy=True)` would give them."""
    if tensor.is_contiguous():
        return tensor.stride()
    return torch.empty_like(tensor, device="meta").stride()


class Arena:
    """Host memory for host copies: a memfd (which the writer process maps too, given its descriptor),
    mapped here for as long as the arena lives. A copy's tensors are made from the arena's `lease`, a
    memoryview of the mapping that each of their storages holds (torch.frombuffer keeps its buffer), so
    the arena is free for the next copy exactly when nothing but the arena refers to its lease."""

    def __init__(self, number: int, size: int):
        self.number, self.size = number, size
        self.fd = os.memfd_create("checkpoint-host-copy", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.lease: memoryview | None = None
        probe = torch.frombuffer(self.map, dtype=torch.uint8, count=1)
        self.address = probe.data_ptr()
        del probe

    def free(self) -> bool:
        # the references to the lease when no tensor holds it: self.lease and getrefcount's argument
        return self.lease is None or sys.getrefcount(self.lease) <= 2

    def lend(self) -> memoryview:
        if self.lease is not None:
            self.lease.release()
        self.lease = memoryview(self.map)
        return self.lease

    def holds(self, tensor: torch.Tensor) -> bool:
        start = tensor.data_ptr()
        return self.address <= start and start + _span(tensor) * tensor.element_size() <= self.address + self.size

    def close(self) -> None:
        if self.lease is not None:
            self.lease.release()
        self.map.close()
        os.close(self.fd)


def _span(tensor: torch.Tensor) -> int:
    """Elements from a tensor's first to its last, inclusive (0 for an empty tensor)."""
    if not tensor.numel():
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


class _HostMemory:
    """The process's arenas: a host copy takes a free one that is large enough (or a new one); free
    arenas it does not take are let go, so only copies that are alive, and the one being made, hold
    memory."""

    def __init__(self):
        self.arenas: list[Arena] = []
        self.lock = threading.Lock()
        self.numbers = 0
        self.usable = hasattr(os, "memfd_create")

    def lend(self, size: int) -> memoryview | None:
        """A lease on `size` bytes of an arena, or None without memfd."""
        if not self.usable:
            return None
        with self.lock:
            free = [arena for arena in self.arenas if arena.free()]
            fitting = [arena for arena in free if arena.size >= size]
            chosen = min(fitting, key=lambda arena: arena.size) if fitting else None
            for arena in free:
                if arena is not chosen:
                    self.arenas.remove(arena)
                    arena.close()
            if chosen is None:
                try:
                    chosen = Arena(self.numbers, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
                except OSError:  # no memfd here (or none of this size): fresh private memory instead
                    return None
                self.numbers += 1
                self.arenas.append(chosen)
            return chosen.lend()

    def holding(self, state) -> "tuple[bool, Arena | None]":
        """(True, the arena) when every non-empty tensor of `state` lies in one arena, (True, None) when
        it has no tensor data, (False, None) otherwise."""
        tensors = _tensors_with_data(state)
        if not tensors:
            return True, None
        with self.lock:
            arena = next((a for a in self.arenas if a.holds(tensors[0])), None)
        if arena is None or not all(t.device.type == "cpu" and arena.holds(t) for t in tensors):
            return False, None
        return True, arena


HOST_MEMORY = _HostMemory()


class Layout:
    """The bytes of a torch.save file of a state whose tensors lie in an arena, as pieces: the small
    ones (zip headers, the pickle) as bytes, each tensor's data as (offset in the arena, length), so
    that the writer process can write the file from the arena without torch. torch.save's zip writer
    hands a file object the storages' own memory (a memoryview of it), which is how a piece is known
    to be in the arena; any other memory is copied, so the file is right whatever torch hands over."""

    def __init__(self, arena: "Arena | None"):
        self.arena, self.pieces, self.small = arena, [], bytearray()

    def write(self, data) -> int:
        data = memoryview(data)
        size = data.nbytes
        start = numpy.frombuffer(data, dtype=numpy.uint8).ctypes.data if size >= _BY_REFERENCE else 0
        if start and self.arena is not None and self.arena.address <= start <= self.arena.address + self.arena.size - size:
            if self.small:
                self.pieces.append(bytes(self.small))
                self.small.clear()
            self.pieces.append((start - self.arena.address, size))
        else:
            self.small += data
        return size

    def flush(self) -> None:
        pass

    @classmethod
    def of(cls, state, arena: "Arena | None") -> list:
        """The pieces, without the zip's CRC-32 checksums: computing them over ~200 MB would cost the
        training thread 30-40 ms, and torch.load does not check them (a changed byte loads as it is,
        with or without); a truncated file is refused either way, by its missing zip directory."""
        layout = cls(arena)
        settings = getattr(_serialization_config, "save", None)
        crc32 = getattr(settings, "compute_crc32", None)
        if crc32 is not None:
            settings.compute_crc32 = False
        try:
            torch.save(state, layout)
        finally:
            if crc32 is not None:
                settings.compute_crc32 = crc32
        if layout.small:
            layout.pieces.append(bytes(layout.small))
        return layout.pieces


_BY_REFERENCE = 4096  # bytes: smaller pieces are copied into the request

"""Where the state lives ([Note: offload schedule], [Note: the all-or-none offloaded step] in __init__.py):
DeviceState (not offloaded), HostState (host memory, pinned for a GPU's copies), DiskState (two
generations of files per rank, streamed through a bounded window by I/O threads). Each holds the state
as named flat tensors (`views()`: what checkpoints read and write); the offloaded ones run phase 3 with
`stream(segments, step)`, calling `step(payload, lo, hi, views)` for every piece [lo, hi) a segment covers.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import fcntl
import json
import math
import mmap
import os
import shutil
import socket
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import OffloadError

__all__ = [
    "DiskState",
    "HostState",
    "ShardFiles",
    "resident_bytes_under",
    "OffloadError",
    "OffloadStats",
    "StateSpec",
    "is_offloaded",
    "state_specs",
    "file_bytes",
    "views_of",
    "window_layout",
]

Views = dict[str, torch.Tensor]
Step = Callable[[object, int, int, Views], None]  # (payload, lo, hi, the state of [lo, hi))
Segment = tuple[int, int, object]  # [lo, hi) of the shard and what the step needs to update it


@dataclass(frozen=True)
class StateSpec:
    """One flat tensor of the state: `per` shard elements per element of it (1, or 8-bit state's block
    for the per-block scales)."""

    name: str
    dtype: torch.dtype
    numel: int
    per: int = 1

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def range(self, lo: int, hi: int) -> slice:
        """Its elements for shard elements [lo, hi) (lo a multiple of `per`)."""
        return slice(lo // self.per, -(-hi // self.per))


@dataclass
class OffloadStats:
    """The last step's I/O: bytes read and written, the seconds the kernel waited for reads and the
    end waited for writes, and the seconds of the whole pass."""

    read_bytes: int = 0
    write_bytes: int = 0
    wait_seconds: float = 0.0
    seconds: float = 0.0


def is_offloaded(state: str | None, delayed_update: bool, device_type: str) -> bool:
    """Whether the state leaves the parameters' memory (OffloadPolicy's `state`): "disk" always;
    "host" unless the model is on the CPU already, where only the delayed update keeps the state
    apart, for its thread to update ([Note: the delayed update])."""
    return state == "disk" or (state == "host" and (device_type != "cpu" or delayed_update))


def state_specs(shard: int, master: bool, state_bits: int, state_block: int) -> list[StateSpec]:
    """The flat tensors of a shard of `shard` elements: the fp32 master (numel 0 when `master` is
    False: fp32 parameters in memory are their own), exp_avg and exp_avg_sq (fp32, or one byte each
    with 8-bit state) and 8-bit state's fp32 scales, one per block of each moment (0 elements in fp32)."""
    quantized = state_bits == 8
    blocks = -(-shard // state_block) if quantized else 0
    moment = torch.uint8 if quantized else torch.float32
    return [
        StateSpec("master", torch.float32, shard if master else 0),
        StateSpec("exp_avg", moment, shard),
        StateSpec("exp_avg_sq", moment, shard),
        StateSpec("exp_avg_scale", torch.float32, blocks, state_block),
        StateSpec("exp_avg_sq_scale", torch.float32, blocks, state_block),
    ]


PAGE = 4096  # direct I/O's unit: buffers, file offsets and lengths are multiples of it


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def window_layout(specs: list[StateSpec], shard: int, window_bytes: int, block: int) -> tuple[int, int]:
    """DiskState's (chunk elements, window bytes): a chunk is a third of `window_bytes` of state,
    less a page per slot, rounded down to a multiple of lcm(block, 4096) elements (a chunk starts at
    an 8-bit block boundary and at a page of every elementwise file, for direct I/O), at least one
    such multiple, at most the shard rounded up to one; the window is three slots of a chunk of every
    kind of state, each rounded up to a page."""
    live = [s for s in specs if s.numel]
    per_element = sum(s.dtype.itemsize / s.per for s in live) or 1.0
    align = math.lcm(block, PAGE)
    whole = max(align, _round_up(shard, align))
    budget = window_bytes - 3 * len(live) * PAGE  # what rounding each slot up to a page may add
    chunk = min(whole, max(align, int(budget / (3 * per_element)) // align * align))
    return chunk, 3 * sum(_slot_bytes(s, chunk) for s in live)


def _slot_bytes(s: StateSpec, chunk: int) -> int:
    return _round_up(s.range(0, chunk).stop * s.dtype.itemsize, PAGE)


def file_bytes(specs: list[StateSpec]) -> int:
    """Bytes of one generation of DiskState's files: each kind's, rounded up to a page."""
    return sum(_round_up(s.nbytes, PAGE) for s in specs if s.numel)


def _aligned(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised buffer of nbytes (a multiple of the dtype's size) starting at a page boundary."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes].view(dtype)


def views_of(specs: list[StateSpec], tensors: Views, lo: int, hi: int, base: int = 0) -> Views:
    """Each spec's tensor over shard elements [lo, hi), the tensors holding the shard from `base`."""
    return {s.name: tensors[s.name][s.range(lo - base, hi - base)] for s in specs}


class DeviceState:
    """The state where it is not offloaded: a tensor per spec on the model's device (the placement
    "host" names a CPU model's state placed on the host, where it is anyway)."""

    offloaded = False
    folder = None
    host_bytes = disk_bytes = window_bytes = 0

    def __init__(self, specs: list[StateSpec], device: torch.device, placement: str = "device"):
        self.specs, self.placement = specs, placement
        self.tensors = {s.name: torch.zeros(s.numel, dtype=s.dtype, device=device) for s in specs}
        self.stats = OffloadStats()

    def views(self) -> Views:
        return self.tensors

    def write(self, name: str, offset: int, values: torch.Tensor) -> None:
        self.tensors[name][offset : offset + values.numel()].copy_(values)

    def commit(self) -> None:
        """Nothing to switch: the state is updated in place (with stage 3's shards in files, by the
        second pass of [Note: the all-or-none step with the state in memory])."""

    def close(self) -> None:
        pass


class HostState:
    """The state in host memory (pinned when `pin`): stepped where it lies, one call per segment."""

    placement = "host"
    offloaded = True

    def __init__(self, specs: list[StateSpec], pin: bool):
        self.specs = specs
        self.tensors = {s.name: torch.zeros(s.numel, dtype=s.dtype, pin_memory=pin) for s in specs}
        self.stats = OffloadStats()

    def views(self) -> Views:
        return self.tensors

    def write(self, name: str, offset: int, values: torch.Tensor) -> None:
        self.tensors[name][offset : offset + values.numel()].copy_(values)

    def stream(self, segments: list[Segment], step: Step) -> None:
        start = time.perf_counter()
        for lo, hi, payload in segments:
            step(payload, lo, hi, views_of(self.specs, self.tensors, lo, hi))
        self.stats = OffloadStats(seconds=time.perf_counter() - start)

    def commit(self) -> None:
        """Nothing to switch: the step wrote the state in place."""

    @property
    def host_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    disk_bytes = 0
    window_bytes = 0
    folder = None

    def close(self) -> None:
        pass


class DiskState:
    """The state in files under `root`: generation g is the state after the last applied step, a
    step writes 1-g and `commit()` switches to it ([Note: the all-or-none offloaded step]).
    `views()` map generation g's files (for checkpoints); a step goes through the window's slots."""

    placement = "disk"
    offloaded = True

    def __init__(
        self,
        specs: list[StateSpec],
        shard: int,
        root: str,
        window_bytes: int,
        io_threads: int,
        align: int,
        direct_io: bool = False,
        keep: bool = False,
    ):
        self.empty = {s.name: torch.zeros(0, dtype=s.dtype) for s in specs if not s.numel}
        self.specs, self.shard, self.root = [s for s in specs if s.numel], shard, root
        self.chunk, self.window_bytes = window_layout(specs, shard, window_bytes, align)
        self.folder, self._lock = _make_folder(root)
        self._fds: dict[tuple[int, str], int] = {}  # buffered: the mappings, the master's first values
        self._direct: dict[tuple[int, str], int] = {}  # O_DIRECT, where the filesystem allows: the window's I/O
        self._pool = cf.ThreadPoolExecutor(io_threads, thread_name_prefix="zerofast-offload-io")
        # Closed when the optimizer is collected or at exit (weakref.finalize runs at exit too): its I/O
        # threads told to end, its files closed and removed ([Note: clean exit] in csrc/work_keeper.cpp).
        self._kept = _kept(self.specs, lambda s: f"{s.name}.{{g}}") if keep else None
        self._finalizer = weakref.finalize(
            self, _close, self._fds, self._direct, self.folder, self._lock, self._pool, self._kept
        )
        need = 2 * file_bytes(self.specs)
        free = shutil.disk_usage(self.folder).free
        if need > free:
            self.close()
            raise OffloadError(
                f"OffloadPolicy(path={root!r}): the optimizer state needs {need} bytes on disk (two generations of "
                f"{need // 2}: [Note: the all-or-none offloaded step]) and the filesystem has {free} free"
            )
        try:
            for g in (0, 1):
                for s in self.specs:
                    path = self._path(g, s)
                    fd = self._fds[(g, s.name)] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                    _preallocate(fd, _round_up(s.nbytes, PAGE))
        except OSError as e:
            self.close()
            raise OffloadError(
                f"OffloadPolicy(path={root!r}): could not create the state's files in {self.folder}: {e}"
            ) from e
        self.direct_io = direct_io and self._open_direct()
        self.gen = 0
        self._mmaps: dict[tuple[int, str], mmap.mmap] = {}
        self._maps = [self._map(0), self._map(1)]
        self._slots: list[Views] | None = None  # the window, allocated at the first step
        self.stats = OffloadStats()
        self.fail_write: Callable[[str, int], None] | None = None  # a test's fault: (file, chunk) -> raise

    def _open_direct(self) -> bool:
        """O_DIRECT descriptors for the files whose chunks are whole pages (the moments and the master;
        8-bit state's small scale files stay buffered); False where the filesystem refuses direct I/O
        (tmpfs, some network filesystems): then every file is read and written through the page cache."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return False
        try:
            for g in (0, 1):
                for s in self.specs:
                    if _slot_bytes(s, self.chunk) == s.range(0, self.chunk).stop * s.dtype.itemsize:
                        self._direct[(g, s.name)] = os.open(self._path(g, s), os.O_RDWR | flag)
        except OSError:
            for fd in self._direct.values():
                os.close(fd)
            self._direct.clear()
            return False
        return bool(self._direct)

    def _path(self, g: int, s: StateSpec) -> str:
        return os.path.join(self.folder, f"{s.name}.{g}")

    def _map(self, g: int) -> Views:
        """Generation g's files as tensors over shared mappings: pages are read (and count as this
        process's resident memory) only where a reader touches them, and release() lets them go."""
        out = {}
        for s in self.specs:
            mapped = mmap.mmap(self._fds[(g, s.name)], s.nbytes, access=mmap.ACCESS_WRITE)
            self._mmaps[(g, s.name)] = mapped
            out[s.name] = torch.frombuffer(mapped, dtype=s.dtype, count=s.numel)
        return out

    def release(self) -> None:
        """Drop the mapped pages a checkpoint touched from this process's resident memory (the bytes
        stay in the files and the page cache)."""
        for mapped in self._mmaps.values():
            mapped.madvise(mmap.MADV_DONTNEED)

    def let_go(self, lo: int = 0, numel: int | None = None) -> None:
        """Drop the live generation's mapped pages of shard elements [lo, lo + numel) (None: to the end)
        from resident memory: what a write through the model's parameters made the master follow
        ([Note: parameters on disk] in __init__.py)."""
        for s in self.specs:
            r = s.range(lo, self.shard if numel is None else min(self.shard, lo + numel))
            _let_go(self._mmaps[(self.gen, s.name)], r.start * s.dtype.itemsize, r.stop * s.dtype.itemsize)

    def write(self, name: str, offset: int, values: torch.Tensor) -> None:
        """`values` at element `offset` of the live generation, through the file, not the mapping
        (whose pages would stay resident)."""
        s = next(s for s in self.specs if s.name == name)
        buf = values.detach().to("cpu", s.dtype).contiguous()  # may be the caller's own storage
        view, done = _bytes_of(buf, buf.numel() * s.dtype.itemsize), 0
        while done < len(view):
            done += os.pwrite(self._fds[(self.gen, name)], view[done:], offset * s.dtype.itemsize + done)

    def views(self) -> Views:
        return {**self.empty, **self._maps[self.gen]}

    @property
    def host_bytes(self) -> int:
        return self.window_bytes if self._slots is not None else 0

    @property
    def disk_bytes(self) -> int:
        return 2 * file_bytes(self.specs)

    def commit(self) -> None:
        """Every rank wrote its next generation: it is the state now."""
        self.gen = 1 - self.gen
        if self._kept is not None:
            self._kept["generation"] = self.gen

    def stream(self, segments: list[Segment], step: Step) -> None:
        """Generation 1-g = generation g with `step` applied to every segment, through the window:
        chunk k+1 read, chunk k stepped, chunk k-1 written, at once. Raises OffloadError (after every
        I/O in flight ended) if a read or write failed; generation g is untouched either way."""
        start = time.perf_counter()
        stats = OffloadStats()  # the last step's stay in self.stats until this one ends (delayed: on a thread)
        chunks = [(lo, min(lo + self.chunk, self.shard)) for lo in range(0, self.shard, self.chunk)]
        work: list[list[Segment]] = [[] for _ in chunks]
        for lo, hi, payload in segments:
            while lo < hi:
                k = lo // self.chunk
                end = min(hi, chunks[k][1])
                work[k].append((lo, end, payload))
                lo = end
        if self._slots is None:
            self._slots = [
                {s.name: _aligned(_slot_bytes(s, self.chunk), s.dtype) for s in self.specs} for _ in range(3)
            ]
        src, dst = self.gen, 1 - self.gen
        pending: dict[tuple[str, int], list[cf.Future]] = {}

        def io(kind: str, k: int) -> None:
            slot, (lo, hi) = self._slots[k % 3], chunks[k]
            fn = self._read if kind == "read" else self._write
            g = src if kind == "read" else dst
            pending[(kind, k)] = [self._pool.submit(fn, g, s, slot[s.name], lo, hi, k) for s in self.specs]

        def wait(kind: str, k: int) -> None:
            t = time.perf_counter()
            for f in pending.pop((kind, k), []):
                nbytes = f.result()
                if kind == "read":
                    stats.read_bytes += nbytes
                else:
                    stats.write_bytes += nbytes
            stats.wait_seconds += time.perf_counter() - t

        try:
            if chunks:
                io("read", 0)
            for k, (c_lo, _) in enumerate(chunks):
                if k + 1 < len(chunks):
                    wait("write", k - 2)  # the slot chunk k+1 reads into held chunk k-2
                    io("read", k + 1)
                wait("read", k)
                for lo, hi, payload in work[k]:
                    step(payload, lo, hi, views_of(self.specs, self._slots[k % 3], lo, hi, c_lo))
                io("write", k)
            for key in sorted(pending, key=lambda kk: kk[1]):
                wait(*key)
        except BaseException:
            futures = [f for fs in pending.values() for f in fs]
            for f in futures:
                f.cancel()
            cf.wait(futures)  # nothing still writing into the window or the files once this returns
            raise
        finally:
            stats.seconds = time.perf_counter() - start
            self.stats = stats

    def _read(self, g: int, s: StateSpec, buf: torch.Tensor, lo: int, hi: int, k: int) -> int:
        return self._io("read", g, s, buf, lo, hi, k)

    def _write(self, g: int, s: StateSpec, buf: torch.Tensor, lo: int, hi: int, k: int) -> int:
        return self._io("write", g, s, buf, lo, hi, k)

    def _io(self, kind: str, g: int, s: StateSpec, buf: torch.Tensor, lo: int, hi: int, k: int) -> int:
        r = s.range(lo, hi)
        nbytes = (r.stop - r.start) * s.dtype.itemsize
        fd = self._direct.get((g, s.name))
        if fd is None:
            fd = self._fds[(g, s.name)]
        else:  # whole pages: the last chunk's tail reads and writes the file's padding
            nbytes = _round_up(nbytes, PAGE)
        view = _bytes_of(buf, nbytes)
        offset = r.start * s.dtype.itemsize
        try:
            if kind == "write" and self.fail_write is not None:
                self.fail_write(self._path(g, s), k)
            _whole_io(kind, fd, view, offset)
        except OSError as e:
            raise OffloadError(
                f"OffloadPolicy(path={self.root!r}): the {kind} of chunk {k} of {self._path(g, s)} "
                f"({nbytes} bytes at byte {offset}) failed: {e}"
            ) from e
        return (r.stop - r.start) * s.dtype.itemsize

    def close(self) -> None:
        """Close the files, remove the folder and stop the I/O threads (idempotent)."""
        self._finalizer()


class ShardFiles:
    """Stage 3's shards in files under `root` (OffloadPolicy(params="disk"): [Note: parameters on disk]
    in __init__.py): one preallocated file per spec (the parameter shard, the gradient shard, the
    frozen parameters' shard), each mapped shared and handed out as a flat tensor, so that every
    reader and writer of a shard (the gathers, the reduces, the kernel, the guard, checkpoints) works
    on it unchanged. A page is read where a reader touches it and counts as this process's resident
    memory until let_go() (the bytes stay in the file and the page cache)."""

    placement = "disk"

    def __init__(self, specs: list[StateSpec], root: str, rank: int, keep: bool = False):
        self.specs, self.root, self.rank = [s for s in specs if s.numel], root, rank
        self.folder, self._lock = _make_folder(root)
        self._fds: dict[str, int] = {}  # read-only: the gathers' explicit reads (read_into)
        self._wfds: dict[str, int] = {}  # the offloaded step's explicit writes (write_from)
        kept = _kept(self.specs, lambda s: s.name) if keep else None
        self._finalizer = weakref.finalize(self, _close_files, [self._fds, self._wfds], self.folder, self._lock, kept)
        self.fail_read: Callable[[str], None] | None = None  # a test's fault: (file) -> raise
        self.fail_write: Callable[[str], None] | None = None
        # The explicit reads and writes so far, by (kind, file): bytes, and seconds inside them summed
        # over the calls (the prefetch's thread and the step's); report().offload shows their sums.
        self.io: dict[tuple[str, str], list] = {}
        self._io_lock = threading.Lock()
        need, free = file_bytes(self.specs), shutil.disk_usage(self.folder).free
        if need > free:
            self.close()
            raise OffloadError(
                f"OffloadPolicy(path={root!r}, params='disk'): rank {rank}'s parameter and gradient shards need "
                f"{need} bytes on disk and the filesystem has {free} free"
            )
        self._maps: dict[str, mmap.mmap] = {}
        self.tensors: dict[str, torch.Tensor] = {s.name: torch.zeros(0, dtype=s.dtype) for s in specs}
        for s in self.specs:
            path = os.path.join(self.folder, s.name)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    _preallocate(fd, _round_up(s.nbytes, PAGE))
                    self._maps[s.name] = mmap.mmap(fd, s.nbytes, access=mmap.ACCESS_WRITE)
                finally:
                    os.close(fd)  # the mapping keeps the file
                self._fds[s.name] = os.open(path, os.O_RDONLY)
                self._wfds[s.name] = os.open(path, os.O_WRONLY)
            except OSError as e:
                self.close()
                raise OffloadError(
                    f"OffloadPolicy(path={root!r}, params='disk'): rank {rank} could not create {path}: {e}"
                ) from e
            self.tensors[s.name] = torch.frombuffer(self._maps[s.name], dtype=s.dtype, count=s.numel)

    @property
    def disk_bytes(self) -> int:
        return file_bytes(self.specs)

    def reader(self, name: str) -> Callable[[int, torch.Tensor], None]:
        """read_into for `name`'s file (a no-op reader for an empty one)."""
        return lambda lo, dst: self.read_into(name, lo, dst)

    def read_into(self, name: str, lo: int, dst: torch.Tensor) -> None:
        """Elements [lo, lo + dst.numel()) of `name` into the contiguous CPU tensor `dst`, by explicit
        reads of the file (through the page cache, coherent with the mapping's writes; no page of the
        mapping becomes resident): a unit's gather, the offloaded step's gradients."""
        self._transfer("read", name, lo, dst)

    def write_from(self, name: str, lo: int, src: torch.Tensor) -> None:
        """The contiguous CPU tensor `src` into elements [lo, lo + src.numel()) of `name`, by explicit
        writes (coherent with the mapping): the offloaded step's updated parameters."""
        self._transfer("write", name, lo, src)

    def _transfer(self, kind: str, name: str, lo: int, t: torch.Tensor) -> None:
        """One explicit read or write; a failure is an OffloadError naming the file and the rank."""
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return
        path, offset = os.path.join(self.folder, name), lo * t.element_size()
        fault = self.fail_read if kind == "read" else self.fail_write
        try:
            if fault is not None:
                fault(path)
            start = time.perf_counter()
            _whole_io(kind, (self._fds if kind == "read" else self._wfds)[name], _bytes_of(t, nbytes), offset)
            seconds = time.perf_counter() - start
            with self._io_lock:
                counted = self.io.setdefault((kind, name), [0, 0.0])
                counted[0] += nbytes
                counted[1] += seconds
        except OSError as e:
            raise OffloadError(
                f"OffloadPolicy(path={self.root!r}, params='disk'): rank {self.rank} could not {kind} {nbytes} bytes "
                f"at byte {offset} of {path}: {e}"
            ) from e

    def io_total(self, kind: str) -> tuple[int, float]:
        """(bytes, seconds) of every explicit `kind` ("read" or "write") so far, over the files."""
        with self._io_lock:
            counts = [v for (k, _), v in self.io.items() if k == kind]
        return sum(b for b, _ in counts), sum(s for _, s in counts)

    def let_go(self, name: str, lo: int = 0, numel: int | None = None) -> None:
        """Drop the resident pages of elements [lo, lo + numel) of `name` (None: to its end), the pages
        at both ends whole: a page another range shares is read again where it is next touched. Safe
        while another thread writes the range (a shared file mapping's dirty pages stay in the page
        cache), so it never waits for a collective in flight."""
        mapped = self._maps.get(name)
        if mapped is None:
            return
        size = self.tensors[name].element_size()
        _let_go(mapped, lo * size, len(mapped) if numel is None else (lo + numel) * size)

    def let_go_all(self) -> None:
        for name in self._maps:
            self.let_go(name)

    def resident_bytes(self) -> int:
        """Bytes of the files' pages this process holds resident now (/proc/self/smaps: Linux)."""
        return resident_bytes_under(self.folder)

    def close(self) -> None:
        """Remove the folder (the mappings end with the last tensor over them; idempotent)."""
        self._finalizer()


def _let_go(mapped: mmap.mmap, start: int, end: int) -> None:
    """MADV_DONTNEED over bytes [start, end) of a shared file mapping, widened to whole pages (what
    another range shares of them is read again from the page cache where it is next touched)."""
    start = start // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(len(mapped), end)
    if end > start:
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)


def resident_bytes_under(folder: str) -> int:
    """Resident bytes of this process's mappings of files under `folder`, from /proc/self/smaps."""
    total, inside = 0, False
    prefix = os.path.join(folder, "")
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if (
                head and "-" in head[0] and len(head) >= 5
            ):  # a mapping's first line: range perms offset dev inode [path]
                inside = len(head) == 6 and head[5].strip().startswith(prefix)
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def _whole_io(kind: str, fd: int, view: memoryview, offset: int) -> None:
    """All of `view` read from (kind "read") or written to `fd` at byte `offset`, as many calls as the
    kernel needs; OSError if one moves nothing."""
    done = 0
    while done < len(view):
        if kind == "read":
            n = os.preadv(fd, [view[done:]], offset + done)
        else:
            n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"{kind} returned {n} at byte {offset + done}")
        done += n


def _bytes_of(t: torch.Tensor, nbytes: int) -> memoryview:
    """The first `nbytes` of a contiguous CPU tensor's memory, for os.pwrite/preadv; valid while `t`
    lives. Not through numpy(): that marks the storage not resizable for good, and stage 3 releases
    (resizes to 0) the parameter buffers a master is first written from."""
    assert t.is_contiguous() and t.device.type == "cpu" and nbytes <= t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


def _preallocate(fd: int, nbytes: int) -> None:
    """Reserve the file's blocks now, so that a full disk is an error at construction, not in a step
    (filesystems without fallocate get a sparse file of the size)."""
    if nbytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (95, 22):  # EOPNOTSUPP, EINVAL: no fallocate here
            raise
        os.ftruncate(fd, nbytes)


_PREFIX = "zerofast-"


def _make_folder(root: str) -> tuple[str, int]:
    """This optimizer's folder under `root` and its held lock ([Note: files of a killed job]); stale
    folders of dead processes removed first."""
    try:
        os.makedirs(root, exist_ok=True)
        _remove_stale(root)
        folder = os.path.join(root, f"{_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        os.mkdir(folder, 0o700)
        lock = os.open(os.path.join(folder, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        raise OffloadError(
            f"OffloadPolicy(path={root!r}): the folder for the optimizer state cannot be created or written: {e}"
        ) from e
    return folder, lock


def _remove_stale(root: str) -> None:
    host = socket.gethostname()
    for entry in os.scandir(root):
        if not (entry.name.startswith(_PREFIX) and entry.is_dir(follow_symlinks=False)):
            continue
        owner = entry.name[len(_PREFIX) :].rsplit("-", 2)
        if len(owner) == 3 and owner[0] == host and owner[1].isdigit() and _alive(int(owner[1])):
            continue  # a live process on this machine (its lock may not be taken yet)
        try:
            fd = os.open(os.path.join(entry.path, "lock"), os.O_RDWR)
        except OSError:
            continue  # being created, or not ours
        if os.path.exists(os.path.join(entry.path, KEPT)):
            os.close(fd)
            continue  # kept on purpose (OffloadPolicy(keep_files=True)): the user's to remove
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: alive (on another machine sharing the folder)
        finally:
            os.close(fd)
        shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _close(fds: dict, direct: dict, folder: str, lock: int, pool: cf.ThreadPoolExecutor, kept: dict | None) -> None:
    # Without waiting: this may run from the garbage collector in any thread, one of the pool's own
    # included (a join there never returns), and a collected store's pool has no work left to wait for
    # (concurrent.futures joins idle workers at the interpreter's exit).
    pool.shutdown(wait=False)
    for fd in [*fds.values(), *direct.values()]:
        os.close(fd)
    fds.clear()
    direct.clear()
    _remove_folder(folder, lock, kept)


def _close_files(tables: list[dict], folder: str, lock: int, kept: dict | None) -> None:
    for fds in tables:
        for fd in fds.values():
            os.close(fd)
        fds.clear()
    _remove_folder(folder, lock, kept)


KEPT = "kept.json"  # in a folder kept on purpose: what its files hold ([Note: files kept on purpose])


def _kept(specs: list[StateSpec], file_of: Callable[[StateSpec], str]) -> dict:
    """What a kept folder's KEPT file will say: each file's tensor (name, dtype, elements)."""
    files = {
        file_of(s): {"tensor": s.name, "dtype": str(s.dtype).removeprefix("torch."), "numel": s.numel} for s in specs
    }
    return {"files": files, "generation": 0}


def _remove_folder(folder: str, lock: int, kept: dict | None = None) -> None:
    if kept is None:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        _keep(folder, kept)
    try:
        os.close(lock)  # the flock goes with it
    except OSError:
        pass


def _keep(folder: str, kept: dict) -> None:
    """[Note: files kept on purpose]: each file flushed to the disk (a write the kernel could not put
    there is named in KEPT's "errors", since nothing can raise in a finalizer), then KEPT written
    (whole or not at all: a temporary file renamed)."""
    generation, errors = kept["generation"], {}
    files = {name.format(g=generation): what for name, what in kept["files"].items()}
    for name in kept["files"]:  # the state on disk: the other generation is no step's state
        if "{g}" in name:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name.format(g=1 - generation)))
    for name in files:
        try:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            errors[name] = str(e)
    if errors:
        warnings.warn(f"OffloadPolicy(keep_files=True): files in {folder} could not be flushed: {errors}", stacklevel=1)
    temporary = os.path.join(folder, KEPT + ".tmp")
    with open(temporary, "w") as f:
        json.dump({"files": files, "errors": errors}, f, indent=1)
    os.replace(temporary, os.path.join(folder, KEPT))

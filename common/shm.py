"""Torch tensors in POSIX shared memory: how the worker shares its KV pool with kvmem.

The worker *creates* the segment (owner-only permissions, an unguessable name) and is
the only process that unlinks it — unless it was killed, when its `SegmentRecord` in the
run dir lets the next worker or the supervisor do it; kvmem *attaches* to it by name.
Both pre-fault every page at once, because the first pass of copies into a freshly mapped
pool runs ~4x slower than later ones (DESIGN §5), and a latency-bound rotation must not
pay that on a request.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import secrets
import stat
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import TYPE_CHECKING

from common.daemon import pid_alive, process_start

if TYPE_CHECKING:  # torch loads where a tensor is made: the supervisor uses only the record
    import torch

SHM_DIR = "/dev/shm"
PAGE = mmap.PAGESIZE
_created: set[str] = set()  # segments this process owns (its resource tracker knows them)


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    import torch

    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def prefault(t: torch.Tensor, write: bool) -> None:
    """Touch one byte per page so that later copies find every page mapped.

    `write=True` (the owner, on fresh zero memory) allocates the pages; an attaching
    process only reads, since the pool may already hold live KV.
    """
    import torch

    flat = t.view(-1).view(torch.uint8)
    pages = flat[::PAGE]
    if write:
        pages.zero_()
    else:
        pages.sum()


class SharedTensor:
    """One tensor backed by one shared-memory segment; `owner` decides who unlinks it."""

    def __init__(self, shm: SharedMemory, tensor: torch.Tensor, owner: bool) -> None:
        self._shm: SharedMemory | None = shm
        self._tensor: torch.Tensor | None = tensor
        self.name = shm.name
        self.owner = owner
        self.nbytes = tensor.numel() * tensor.element_size()

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeError(f"shared tensor {self.name} is closed")
        return self._tensor

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype, prefix: str = "si-kv") -> SharedTensor:
        nbytes = tensor_nbytes(shape, dtype)
        if nbytes <= 0:
            raise ValueError(f"a shared tensor needs at least one element, got shape {shape}")
        # 64 random bits: another local user cannot guess the name to open a segment
        # before we create it, and create=True (O_EXCL) refuses one that already exists.
        shm = SharedMemory(name=f"{prefix}-{secrets.token_hex(8)}", create=True, size=nbytes)
        _owner_only(shm.name)
        _created.add(shm.name)
        tensor = _as_tensor(shm, shape, dtype)
        prefault(tensor, write=True)
        return cls(shm, tensor, owner=True)

    @classmethod
    def attach(cls, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> SharedTensor:
        nbytes = tensor_nbytes(shape, dtype)
        shm = SharedMemory(name=name)
        # Python < 3.13 registers attached segments with this process's resource tracker,
        # which would unlink the worker's pool when *we* exit. Only the owner unlinks.
        if shm.name not in _created:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        if shm.size < nbytes:
            shm.close()
            raise ValueError(f"shared memory {name} holds {shm.size} bytes, need {nbytes}")
        tensor = _as_tensor(shm, shape, dtype)
        prefault(tensor, write=False)
        return cls(shm, tensor, owner=False)

    def close(self) -> None:
        """Unmap (and, as owner, unlink). Safe to call twice."""
        if self._shm is None:
            return
        shm, self._shm = self._shm, None
        self._tensor = None
        if self.owner:
            _created.discard(shm.name)
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        try:
            shm.close()
        except BufferError:
            # A view of the tensor is still alive somewhere; the mapping then goes away
            # with the process. The name is already unlinked, which is what matters.
            pass


def _as_tensor(shm: SharedMemory, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    import torch

    count = math.prod(shape)
    return torch.frombuffer(shm.buf, dtype=dtype, count=count).view(shape)


def _owner_only(name: str) -> None:
    """SharedMemory asks for 0o600 already; enforce it in case a platform widened it."""
    path = os.path.join(SHM_DIR, name)
    if not os.path.exists(path):
        return  # not a Linux-style /dev/shm; shm_open's mode is all we have
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        os.chmod(path, 0o600)


class SegmentRecord:
    """`<run_dir>/<service>.shm`: the segments a process created, its pid and start time.

    A process killed with SIGKILL cannot unlink its segments, and /dev/shm keeps them
    until reboot. The record lets whoever comes next — the restarted service, or the
    supervisor that saw it die — unlink them, and never a live process's segments. The
    start time tells a restarted service from the one that wrote the record when both
    have one pid (pid 1 in a container).
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def _read(self) -> tuple[int | None, int | None, list[str]]:
        try:
            data = json.loads(self.path.read_text())
            start = data.get("start")
            return (int(data["pid"]), None if start is None else int(start),
                    [str(n) for n in data["segments"]])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None, None, []

    @staticmethod
    def _same(pid: int | None, start: int | None, other: int) -> bool:
        """Is the recorded (pid, start) the live process `other`? Yes when unsure."""
        if pid != other:
            return False
        now = process_start(other)
        return start is None or now is None or now == start

    def _write(self, names: list[str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".shm.tmp")
        me = os.getpid()
        tmp.write_text(json.dumps({"pid": me, "start": process_start(me), "segments": names}))
        tmp.replace(self.path)  # atomic: a reader never sees half a record

    def add(self, name: str) -> None:
        pid, start, names = self._read()
        self._write([*(names if self._same(pid, start, os.getpid()) else []), name])

    def remove(self, name: str) -> None:
        pid, start, names = self._read()
        if not self._same(pid, start, os.getpid()):
            return
        rest = [n for n in names if n != name]
        if rest:
            self._write(rest)
        else:
            self.path.unlink(missing_ok=True)

    def reap(self, dead_pid: int | None = None) -> list[str]:
        """Unlink the segments of a recorded process that is gone; return their names.

        `dead_pid`: only if the record is that process's (the supervisor knows which
        child died); otherwise whenever the recorded process is no longer alive.
        """
        pid, start, names = self._read()
        if pid is None or self._same(pid, start, os.getpid()):
            return []
        if dead_pid is not None and pid != dead_pid:
            return []
        if pid_alive(pid) and self._same(pid, start, pid):
            return []
        removed = []
        for name in names:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass  # already gone (Python's resource tracker may have beaten us to it)
            except OSError:
                continue
        self.path.unlink(missing_ok=True)
        return removed

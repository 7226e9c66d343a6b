"""The collectives tensor-parallel ranks run, behind one interface with two transports.

`TorchDistCommunicator` runs them over a torch.distributed process group (gloo on CPU: across hosts).
`ShmCommunicator` runs them through a shared-memory segment for ranks on one host (the C++ ops of
kernels/cpu/shm_comm.cpp), with no sockets or copies through the kernel (benchmarks/allreduce.py compares them).
Both sum bf16/fp16 in fp32 and round once, and every rank gets bit-identical results, so the ranks' hidden states
never drift apart.

A communicator is used by one thread of its rank. Its ops release the GIL while they wait, so other Python threads
run meanwhile (one of them may call `ShmCommunicator.abort`).
"""
from __future__ import annotations

import mmap
import os
import pickle
import weakref
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from pagoda.kernels import cpu_extension

# Per rank and buffer: a larger tensor goes through in chunks of this size. 4 MiB holds a step's hidden states
# for ~1k tokens of a 1k-wide fp32 model; the segment is 2 * world_size of these.
DEFAULT_MAX_BYTES = 4 << 20
_SHM_DIR = Path("/dev/shm")


class Communicator(Protocol):
    """The collectives of one rank among `world_size`; every rank makes the same calls in the same order."""

    rank: int
    world_size: int

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` (fp32, bf16 or fp16, contiguous) over the ranks in place; 16-bit types accumulate in fp32."""
        ...

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (the same shape on each), stacked in rank order: [world_size, *t.shape]."""
        ...

    def broadcast_object(self, obj: object | None) -> object:
        """Rank 0's picklable `obj` on every rank (the others pass None)."""
        ...

    def close(self) -> None:
        """Release this rank's resources; the communicator is unusable afterwards."""
        ...


@dataclass(eq=False)
class TorchDistCommunicator:
    """Over an initialized torch.distributed process group (None: the default group), which the caller owns."""

    group: dist.ProcessGroup | None = None
    rank: int = field(init=False)
    world_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    def all_reduce(self, t: torch.Tensor) -> None:
        if t.dtype not in (torch.bfloat16, torch.float16):
            dist.all_reduce(t, group=self.group)
            return
        # gloo would round after every partial sum: one rounding, as ShmCommunicator does.
        acc = t.float()
        dist.all_reduce(acc, group=self.group)
        t.copy_(acc)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty((self.world_size, *t.shape))
        dist.all_gather(list(out.unbind(0)), t.contiguous(), group=self.group)
        return out

    def broadcast_object(self, obj: object | None) -> object:
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def close(self) -> None:
        """Nothing to release: the caller destroys its process group."""


@dataclass(eq=False)
class ShmCommunicator:
    """Ranks of one host (and one pid namespace) sharing the segment /dev/shm/<name>: rank 0 `create`s it, with a
    name unique on the host, before it starts the other ranks, which `attach` with the same world_size and
    max_bytes. Each rank registers its pid in the segment, and a call waiting on a peer whose process has exited
    raises RuntimeError naming that rank within ~50 ms; `abort` ends every rank's waiting call.

    Rank 0 unlinks the name once every rank has attached (when its first collective returns), at `close`, or at
    its exit, whichever comes first; the mappings live on. So only a rank 0 killed before its first collective
    leaves a file behind. Tensors and objects of any size pass, in rounds of `max_bytes` (rounded up to whole
    pages); the segment holds 2 * world_size of these."""

    rank: int
    world_size: int
    max_bytes: int
    _mmap: mmap.mmap = field(repr=False)
    _segment: torch.Tensor | None = field(repr=False)  # a uint8 view of _mmap; None once closed
    _unlink: weakref.finalize | None = field(default=None, repr=False)  # rank 0's, while the name exists

    @classmethod
    def create(cls, name: str, world_size: int, max_bytes: int = DEFAULT_MAX_BYTES) -> ShmCommunicator:
        """Rank 0: create the segment (failing if `name` exists) and register."""
        _require_kernels()
        slot = _slot_bytes(max_bytes)
        path = _segment_path(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            size = torch.ops.pagoda.shm_comm_segment_bytes(world_size, slot)
            # Reserve the pages now: a full /dev/shm then fails here, not with SIGBUS at a later first touch.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            path.unlink()
            raise
        finally:
            os.close(fd)
        comm = cls(0, world_size, slot, mm, torch.frombuffer(mm, dtype=torch.uint8))
        comm._unlink = weakref.finalize(comm, path.unlink, missing_ok=True)
        torch.ops.pagoda.shm_comm_register(comm._segment, 0, world_size, slot)
        return comm

    @classmethod
    def attach(cls, name: str, rank: int, world_size: int, max_bytes: int = DEFAULT_MAX_BYTES) -> ShmCommunicator:
        """Ranks 1..world_size-1: map the segment rank 0 created (with the same world_size and max_bytes)."""
        _require_kernels()
        slot = _slot_bytes(max_bytes)
        try:
            fd = os.open(_segment_path(name), os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(f"no shared-memory segment {name!r}: rank 0 creates it before it starts the "
                                    "other ranks, and unlinks it once they have all attached") from None
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        comm = cls(rank, world_size, slot, mm, torch.frombuffer(mm, dtype=torch.uint8))
        torch.ops.pagoda.shm_comm_register(comm._segment, rank, world_size, slot)
        return comm

    def all_reduce(self, t: torch.Tensor) -> None:
        torch.ops.pagoda.shm_all_reduce(self._live(), self.rank, t)
        self._all_attached()

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty((self.world_size, *t.shape))
        torch.ops.pagoda.shm_all_gather(self._live(), self.rank, t.contiguous(), out)
        self._all_attached()
        return out

    def broadcast_object(self, obj: object | None) -> object:
        data = None
        if self.rank == 0:
            buf = BytesIO()
            pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
            data = torch.frombuffer(buf.getbuffer(), dtype=torch.uint8)
        out = torch.ops.pagoda.shm_broadcast_bytes(self._live(), self.rank, data)
        self._all_attached()
        return obj if self.rank == 0 else pickle.loads(out.numpy())

    def abort(self, reason: str) -> None:
        """Make every rank's current and later calls raise RuntimeError with `reason` (callable from any thread)."""
        torch.ops.pagoda.shm_comm_abort(self._live(), self.rank, reason)

    def close(self) -> None:
        if self._segment is None:
            return
        self._segment = None  # the tensor holds a buffer export, which must go before the mmap can close
        self._mmap.close()
        if self._unlink is not None:
            self._unlink()

    def _live(self) -> torch.Tensor:
        if self._segment is None:
            raise RuntimeError("the communicator is closed")
        return self._segment

    def _all_attached(self) -> None:
        # A collective returned, so every rank has mapped the segment: its name is no longer needed.
        if self._unlink is not None:
            self._unlink()
            self._unlink = None


def _require_kernels() -> None:
    try:
        cpu_extension.load()
    except cpu_extension.KernelBuildError as e:
        raise RuntimeError("ShmCommunicator needs Pagoda's C++ CPU kernels, which did not build here; "
                           f"TorchDistCommunicator (gloo) works without them ({e})") from e


def _slot_bytes(max_bytes: int) -> int:
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, not {max_bytes}")
    return -(-max_bytes // 4096) * 4096  # whole pages: every slot starts cache-line aligned


def _segment_path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"a shared-memory segment name is one file name, not {name!r}")
    return _SHM_DIR / name

"""Tensor-parallel execution: rank 0 (the engine's process, with the scheduler and the KV manager) and worker
ranks that run every step it runs on their shard of the model.

On one host the engine spawns its workers itself and the ranks talk through shared memory
(distributed/communicator.py ShmCommunicator); each rank is bound to its own share of the cores. Across hosts
every rank is started by torchrun and they talk through torch.distributed (gloo): rank 0 runs the command
(`pagoda serve`), the others `worker_loop`. Either way rank 0 broadcasts each command (a StepInput, a KV pool
size, block copies) and then runs it itself; the model's collectives keep the ranks in step.

A rank that dies ends the engine: the next collective names it (WorkerDiedError), and the engine stops rather
than hang.
"""
from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed

from pagoda.config import EngineConfig, resolve_dtype
from pagoda.core.scheduler import SchedulerOutput
from pagoda.cpus import affinity, cgroup_cpu_limit, default_threads
from pagoda.distributed.communicator import Communicator, ShmCommunicator, TorchDistCommunicator
from pagoda.distributed.errors import WorkerDiedError
from pagoda.distributed.tensor_parallel import Shard, split
from pagoda.executor.model_runner import ModelOutput, ModelRunner, StepInput, rows_input, step_input
from pagoda.kernels.policy import KernelPolicy
from pagoda.model.args import ModelArgs
from pagoda.model.loader import ModelFiles, resolve_model_files
from pagoda.spawn import main_module_not_rerun

logger = logging.getLogger(__name__)

# Workers load their shard while rank 0 loads its own; this bounds how long rank 0 waits for the slowest.
_START_TIMEOUT_S = 600.0
_SHM_BYTES = 16 << 20  # the shared segment's per-rank slot: a step's all-reduce or logits slice fits whole


# ---- commands rank 0 broadcasts --------------------------------------------------------------------
@dataclass
class AllocateKV:
    num_blocks: int


@dataclass
class CopyBlocks:
    copies: list[tuple[int, int]]


@dataclass
class Run:
    step: StepInput


@dataclass
class Stop:
    pass


def _apply(runner: ModelRunner, cmd: AllocateKV | CopyBlocks | Run) -> ModelOutput | None:
    """What every rank does with a command (rank 0 keeps the output)."""
    if isinstance(cmd, AllocateKV):
        runner.allocate_kv_cache(cmd.num_blocks)
    elif isinstance(cmd, CopyBlocks):
        runner.copy_blocks(cmd.copies)
    else:
        return runner.run(cmd.step)
    return None


def worker_loop(runner: ModelRunner, comm: Communicator) -> None:
    """A worker rank: run what rank 0 broadcasts until it says Stop (or dies: the broadcast raises)."""
    while True:
        cmd = comm.broadcast_object(None)
        if isinstance(cmd, Stop):
            return
        _apply(runner, cmd)


def bind_cores(rank: int, world: int) -> None:
    """Bind this process to rank `rank`'s share of the cores it may run on, one compute thread per core."""
    cores, limit = affinity(), cgroup_cpu_limit()
    if len(cores) >= world:
        mine = [cores[i] for i in split(len(cores), world, rank)]
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(default_threads(mine, None if limit is None else limit / world))
    else:  # more ranks than cores: share them, one thread each
        torch.set_num_threads(1)


def _spawned_worker(rank: int, world: int, config: EngineConfig, files: ModelFiles, args: ModelArgs,
                    shm_name: str, ready: mp.Queue) -> None:
    """Entry point of a worker that rank 0 spawned on this host."""
    try:
        bind_cores(rank, world)
        comm = ShmCommunicator.attach(shm_name, rank, world, _SHM_BYTES)
        runner = ModelRunner(config, files, args, resolve_dtype(config.dtype, config.device),
                             config.kernel_policy(), Shard.of(args, rank, world), comm)
    except BaseException:
        ready.put((rank, traceback.format_exc()))
        raise
    ready.put((rank, None))
    try:
        worker_loop(runner, comm)
    finally:
        comm.close()


class TensorParallelRunner:
    """Rank 0's runner: the ModelRunner of its own shard, with every call broadcast to the other ranks first.
    It answers what ModelRunner answers (the engine and the speculator use either)."""

    def __init__(self, local: ModelRunner, comm: Communicator, workers: list[mp.process.BaseProcess]) -> None:
        self.local, self.comm, self.workers = local, comm, workers
        # What the engine, the speculator and the benchmarks read of a runner.
        self.config, self.policy, self.args, self.dtype = local.config, local.policy, local.args, local.dtype
        self.block_size, self.model = local.block_size, local.model

    @classmethod
    def start(cls, config: EngineConfig, files: ModelFiles, args: ModelArgs, dtype: torch.dtype,
              policy: KernelPolicy) -> TensorParallelRunner:
        """Rank 0 of `config.tensor_parallel_size` ranks: spawned here on this host, or, under torchrun, the
        ranks torchrun started (their process group is initialized here)."""
        world = config.tensor_parallel_size
        shards = [Shard.of(args, r, world) for r in range(world)]  # a size that cannot split fails here, once
        if launched_by_torchrun():
            comm = torchrun_communicator(world)
            bind_cores(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
            logger.info("tensor parallel: %d ranks started by torchrun, torch.distributed (gloo) collectives", world)
            return cls(ModelRunner(config, files, args, dtype, policy, shards[0], comm), comm, [])
        name = f"pagoda-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        comm = ShmCommunicator.create(name, world, _SHM_BYTES)
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        workers = [ctx.Process(target=_spawned_worker, args=(r, world, config, files, args, name, ready),
                               name=f"pagoda-tp-rank{r}", daemon=True) for r in range(1, world)]
        outputs: list[RankOutput] = []
        try:
            with main_module_not_rerun():
                for r, w in enumerate(workers, start=1):
                    outputs.append(RankOutput.start(w, r))
            watch = StartupWatch(ready, workers, outputs, comm, _START_TIMEOUT_S)
            bind_cores(0, world)
            try:
                local = ModelRunner(config, files, args, dtype, policy, shards[0], comm)
            except RuntimeError as e:  # a collective that the watch aborted: say why
                watch.raise_failure(e)
                raise
            watch.wait()
        except BaseException:
            for w in workers:
                if w.pid is not None:  # started
                    w.kill()
            comm.close()
            raise
        logger.info("tensor parallel: %d ranks on this host, shared-memory collectives", world)
        return cls(local, comm, workers)

    def _broadcast(self, cmd: AllocateKV | CopyBlocks | Run | Stop) -> None:
        try:
            self.comm.broadcast_object(cmd)
        except RuntimeError as e:
            raise WorkerDiedError(f"tensor parallelism: {e}") from e

    def _call(self, cmd: AllocateKV | CopyBlocks | Run) -> ModelOutput | None:
        self._broadcast(cmd)
        try:
            return _apply(self.local, cmd)
        except RuntimeError as e:
            # A spawned worker that exited, or a peer torch.distributed lost (torchrun): no step can run again.
            if not isinstance(e, torch.distributed.DistBackendError) and self.alive(grace_s=0.5):
                raise
            raise WorkerDiedError(f"tensor parallelism: a rank exited during a step ({e})") from e

    def alive(self, grace_s: float = 0.0) -> bool:
        """Whether every spawned worker runs; `grace_s`: first wait that long for an exit the collectives may have
        seen before this process reaps it."""
        for w in self.workers:
            w.join(timeout=grace_s)
        return all(w.is_alive() for w in self.workers)

    def kv_bytes_per_block(self) -> int:
        return self.local.kv_bytes_per_block()  # rank 0 holds the most KV heads of any rank (Shard.of)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call(AllocateKV(num_blocks))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            self._call(CopyBlocks(copies))

    def execute(self, sched: SchedulerOutput, block_tables: dict[int, list[int]]) -> ModelOutput:
        return self.run(step_input(sched, block_tables, self.block_size))

    def run(self, step: StepInput) -> ModelOutput:
        out = self._call(Run(step))
        assert out is not None
        return out

    def forward_rows(self, rows: list[tuple[list[int], int, list[int]]], num_layers: int | None = None) -> torch.Tensor:
        return self.run(rows_input(rows, self.block_size, num_layers)).sample_logits

    def close(self) -> None:
        """Stop the workers (they exit on their own if this process dies first: the collectives watch rank 0)."""
        if self.workers and self.alive():
            try:
                self._broadcast(Stop())
            except WorkerDiedError:
                pass
        for w in self.workers:
            w.join(timeout=5)
            if w.is_alive():
                w.kill()
        self.comm.close()


@dataclass
class RankOutput:
    """A spawned rank's stderr and stdout, passed on to this process's stderr line by line with its rank, and the
    last lines kept: what the rank said before it died goes into the parent's error."""

    rank: int
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=40))

    @classmethod
    def start(cls, worker: mp.process.BaseProcess, rank: int) -> RankOutput:
        """Start `worker` with its fds 1 and 2 on a pipe that a thread of this process reads."""
        out = cls(rank)
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        try:
            # spawn's child inherits fds 1 and 2 as they are at its start; this process keeps its own.
            os.dup2(write_fd, 1)
            os.dup2(write_fd, 2)
            worker.start()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in (*saved, write_fd):
                os.close(fd)
        threading.Thread(target=out._relay, args=(read_fd,), name=f"pagoda-tp-rank{rank}-output",
                         daemon=True).start()
        return out

    def _relay(self, fd: int) -> None:
        with os.fdopen(fd, "r", errors="replace") as pipe:
            for line in pipe:
                self.tail.append(line.rstrip("\n"))
                sys.stderr.write(f"(tp rank {self.rank}) {line}")
                sys.stderr.flush()

    def last_words(self, grace_s: float = 0.5) -> str:
        deadline = time.monotonic() + grace_s  # the pipe may still hold the dead rank's last lines
        while not self.tail and time.monotonic() < deadline:
            time.sleep(0.02)
        return "\n".join(self.tail)


class StartupWatch:
    """Watches the spawned ranks while rank 0 loads its own shard. A rank that reports an error, exits, or is not
    ready by the deadline aborts the communicator, so a collective rank 0 is waiting in raises at once, and the
    error names that rank with its own words."""

    def __init__(self, ready: mp.Queue, workers: list[mp.process.BaseProcess], outputs: list[RankOutput],
                 comm: ShmCommunicator, timeout_s: float) -> None:
        self.failure: str | None = None
        self._ready, self._workers, self._outputs, self._comm = ready, workers, outputs, comm
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._thread = threading.Thread(target=self._run, name="pagoda-tp-startup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pending = set(range(1, len(self._workers) + 1))
        while pending and self.failure is None:
            try:
                rank, error = self._ready.get(timeout=0.1)
            except queue.Empty:
                dead = [r for r in sorted(pending) if not self._workers[r - 1].is_alive()]
                if dead:
                    r = dead[0]
                    self._fail(f"tensor-parallel rank {r} exited during start-up (exit code "
                               f"{self._workers[r - 1].exitcode}). It said:\n{self._outputs[r - 1].last_words()}")
                elif time.monotonic() > self._deadline:
                    self._fail(f"tensor-parallel ranks {sorted(pending)} not ready after {self._timeout_s:.0f}s")
                continue
            if error is not None:
                self._fail(f"tensor-parallel rank {rank} failed to start:\n{error}")
            pending.discard(rank)

    def _fail(self, message: str) -> None:
        self.failure = message
        self._comm.abort(message)

    def raise_failure(self, cause: BaseException) -> None:
        """Raise WorkerDiedError where a rank failed (`cause`: what that made rank 0's own start raise)."""
        if self.failure is not None:
            raise WorkerDiedError(self.failure) from cause

    def wait(self) -> None:
        """Until every rank is ready; WorkerDiedError where one is not."""
        self._thread.join()
        if self.failure is not None:
            raise WorkerDiedError(self.failure)


# ---- torchrun (several hosts) ----------------------------------------------------------------------
def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def torchrun_communicator(world: int) -> TorchDistCommunicator:
    """Join torchrun's process group (gloo; rendezvous from MASTER_ADDR/MASTER_PORT) and check its size."""
    import torch.distributed as dist

    if int(os.environ["WORLD_SIZE"]) != world:
        raise ValueError(f"tensor_parallel_size {world} but torchrun started {os.environ['WORLD_SIZE']} ranks")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return TorchDistCommunicator(dist.group.WORLD)


def run_torchrun_worker(config: EngineConfig) -> None:
    """A rank > 0 started by torchrun: load this rank's shard and run rank 0's commands until it stops."""
    world, rank = config.tensor_parallel_size, int(os.environ["RANK"])
    files = resolve_model_files(config.model)
    args = ModelArgs.from_hf_config(files.hf_config)
    comm = torchrun_communicator(world)
    bind_cores(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    runner = ModelRunner(config, files, args, resolve_dtype(config.dtype, config.device), config.kernel_policy(),
                         Shard.of(args, rank, world), comm)
    logger.info("tensor-parallel rank %d of %d ready", rank, world)
    worker_loop(runner, comm)

"""The tensor-parallel collectives (pagoda/distributed/communicator.py): the shared-memory transport against gloo,
bit-identical results on every rank, a dead rank or an abort ending a wait, and idle waiters sleeping.

Each test starts its ranks as spawned processes of one thread each; rank 0 creates the segment before the others
attach, and every rank also joins a gloo group over loopback for the reference collectives."""
from __future__ import annotations

import functools
import hashlib
import os
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagoda.distributed.communicator import Communicator, ShmCommunicator, TorchDistCommunicator
from pagoda.kernels import cpu_extension

MAX_BYTES = 1 << 20  # small, so the 4 MB tensors and objects go through in several rounds
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX shared memory (/dev/shm) only")


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if not cpu_extension.load():
        pytest.skip("the C++ CPU kernels did not build")


Scenario = Callable[[int, Communicator, Communicator], object]


def _rank_main(scenario: Scenario, rank: int, world_size: int, build: str, port: int, name: str,
               created: object, results: object) -> None:
    torch.set_num_threads(1)
    cpu_extension.load(build)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    shm = None
    try:
        if rank == 0:
            shm = ShmCommunicator.create(name, world_size, MAX_BYTES)
            created.set()
        else:
            created.wait()
            shm = ShmCommunicator.attach(name, rank, world_size, MAX_BYTES)
        results.put((rank, scenario(rank, shm, TorchDistCommunicator())))
    except BaseException:
        results.put((rank, RuntimeError(traceback.format_exc())))
    finally:
        if shm is not None:
            shm.close()
        dist.destroy_process_group()


def run_ranks(scenario: Scenario, world_size: int = 2, reporting: int | None = None) -> dict[int, object]:
    """What `scenario` returns on each rank (on the first `reporting` ranks only, where the others die)."""
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = f"pagoda-test-{uuid.uuid4().hex[:12]}"
    created, results = ctx.Event(), ctx.Queue()
    build = cpu_extension.loaded_build()
    procs = [ctx.Process(target=_rank_main, args=(scenario, r, world_size, build, port, name, created, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        out = dict(results.get(timeout=60) for _ in range(world_size if reporting is None else reporting))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert not (Path("/dev/shm") / name).exists(), "rank 0 left its segment behind"
    for r, value in out.items():
        if isinstance(value, BaseException):
            raise AssertionError(f"rank {r} failed:\n{value}")
    return out


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 1_000_003 + numel * 7 + DTYPES.index(dtype))
    return torch.randn(numel, generator=g).to(dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def _all_reduce_cases(numels: list[int], exact_gloo: bool, rank: int, shm: Communicator, gloo: Communicator) -> object:
    report = {}
    for dtype in DTYPES:
        for numel in numels:
            ours, theirs = _input(rank, numel, dtype), _input(rank, numel, dtype)
            shm.all_reduce(ours)
            dist.all_reduce(theirs)
            # the contract: the sum in rank order, in fp32, rounded once
            ref = functools.reduce(torch.add, [_input(r, numel, dtype).float() for r in range(shm.world_size)])
            tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
            like_gloo = (torch.equal(ours, theirs) if exact_gloo
                         else torch.allclose(ours.float(), theirs.float(), rtol=tol, atol=tol))
            report[(str(dtype), numel)] = (like_gloo, torch.equal(ours, ref.to(dtype)), _digest(ours))
    return report


def _check_all_reduce(report: dict[int, object]) -> None:
    cases = report[0]
    for case, (like_gloo, like_ref, digest) in cases.items():
        assert like_gloo, f"{case}: shm all_reduce differs from gloo's"
        assert like_ref, f"{case}: shm all_reduce differs from the fp32 sum in rank order"
        assert all(report[r][case][2] == digest for r in report), f"{case}: ranks hold different results"


def test_shm_all_reduce_equals_gloo_on_two_ranks_bit_identically():
    # bytes 4 B .. 4 MB of fp32; 1<<20 + 3 elements are over MAX_BYTES in every dtype: several rounds, a ragged end
    numels = [1, 7, 1024, 16_384 + 5, 262_144, 1 << 20, (1 << 20) + 3]
    _check_all_reduce(run_ranks(functools.partial(_all_reduce_cases, numels, True)))


def test_shm_all_reduce_on_three_ranks_sums_in_rank_order():
    # gloo's three-way sum rounds or orders its partial sums otherwise: close to it, equal to the rank-order sum
    _check_all_reduce(run_ranks(functools.partial(_all_reduce_cases, [7, 4096, 300_001], False), world_size=3))


def _gather_and_broadcast(rank: int, shm: Communicator, gloo: Communicator) -> object:
    checks = {}
    big = {"tokens": list(range(120_000)), "blob": bytes(range(256)) * 1024}  # ~1.3 MB pickled: > MAX_BYTES
    for comm_name, comm in (("shm", shm), ("gloo", gloo)):
        for shape, dtype in (((3, 5), torch.float32), ((7,), torch.bfloat16), ((), torch.float16),
                             ((1 << 19,), torch.float32)):  # 2 MB: two rounds
            t = torch.full(shape, float(rank + 1), dtype=dtype)
            out = comm.all_gather(t)
            expected = torch.stack([torch.full(shape, float(r + 1), dtype=dtype) for r in range(comm.world_size)])
            checks[f"{comm_name} all_gather {shape} {dtype}"] = torch.equal(out, expected)
        for obj_name, obj in (("small", {"step": 3, "ids": [1, 2]}), ("1 MB", big), ("None", None)):
            got = comm.broadcast_object(obj if rank == 0 else None)
            checks[f"{comm_name} broadcast {obj_name}"] = got == obj
    return checks


def test_all_gather_and_broadcast_object_on_both_transports():
    report = run_ranks(_gather_and_broadcast)
    failed = [case for checks in report.values() for case, ok in checks.items() if not ok]
    assert not failed


def _die_in_all_reduce(rank: int, shm: Communicator, gloo: Communicator) -> object:
    shm.all_reduce(torch.ones(16))  # both ranks attached and in step
    if rank == 1:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        shm.all_reduce(torch.ones(16))
    except RuntimeError as e:
        return str(e), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def test_a_killed_rank_ends_the_survivors_wait_with_an_error_naming_it():
    message, waited = run_ranks(_die_in_all_reduce, reporting=1)[0]
    assert "tensor-parallel rank 1 (pid " in message and "exited" in message
    assert waited < 5


def test_abort_wakes_a_rank_waiting_from_another_thread():
    # rank 1 never attaches: rank 0 would wait for ever, and the waiting op must leave the GIL to the aborting thread
    name = f"pagoda-test-{uuid.uuid4().hex[:12]}"
    comm = ShmCommunicator.create(name, 2, MAX_BYTES)
    try:
        threading.Timer(0.2, comm.abort, args=("the engine stopped",)).start()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="aborted by rank 0: the engine stopped"):
            comm.all_reduce(torch.ones(4))
        assert time.monotonic() - t0 < 5
        with pytest.raises(RuntimeError, match="aborted"):  # and every later call
            comm.broadcast_object({"step": 1})
    finally:
        comm.close()
    assert not (Path("/dev/shm") / name).exists()


def _idle_wait(rank: int, shm: Communicator, gloo: Communicator) -> object:
    shm.all_reduce(torch.ones(1))  # in step
    if rank == 0:
        time.sleep(1.0)
        shm.broadcast_object("next step")
        return None
    cpu0, t0 = time.process_time(), time.monotonic()
    got = shm.broadcast_object(None)
    return got, time.process_time() - cpu0, time.monotonic() - t0


def test_a_rank_waiting_idle_sleeps_instead_of_spinning():
    got, cpu, waited = run_ranks(_idle_wait)[1]
    assert got == "next step" and waited > 0.8
    assert cpu < 0.2 * waited, f"{cpu:.3f} s of CPU in a {waited:.3f} s wait"

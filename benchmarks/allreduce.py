"""All-reduce latency of the shared-memory transport against gloo: `python -m benchmarks.allreduce [--ranks 2]`.

`--ranks` processes of one thread each (one core each: run it on a machine with that many idle cores) time
back-to-back all-reduces of every size and dtype on both transports, and rank 0 prints the median per call as a
markdown table. Calls run back to back, so the ranks stay in step and the figure is the transport's own cost.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import time
import uuid

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagoda.distributed.communicator import Communicator, ShmCommunicator, TorchDistCommunicator

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]  # bytes


def median_us(comm: Communicator, t: torch.Tensor, iters: int) -> float:
    for _ in range(max(3, iters // 10)):  # warm-up: page faults, gloo's buffers
        comm.all_reduce(t)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        comm.all_reduce(t)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def rank_main(rank: int, args: argparse.Namespace, port: int, name: str, created: object) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    if rank == 0:
        shm = ShmCommunicator.create(name, args.ranks)
        created.set()
    else:
        created.wait()
        shm = ShmCommunicator.attach(name, rank, args.ranks)
    gloo = TorchDistCommunicator()
    rows = []
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for nbytes in SIZES:
            # values that stay finite after every iteration's sum, in each dtype
            t = torch.full((nbytes // dtype.itemsize,), 1.0 / args.ranks, dtype=dtype)
            rows.append((str(dtype).removeprefix("torch."), nbytes, median_us(gloo, t, args.iters),
                         median_us(shm, t, args.iters)))
    shm.close()
    dist.destroy_process_group()
    if rank == 0:
        print(f"all_reduce, {args.ranks} ranks, median of {args.iters} calls\n")
        print("| dtype | size | gloo µs | shm µs | gloo/shm |")
        print("|---|---:|---:|---:|---:|")
        for dtype, nbytes, g, s in rows:
            size = f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"
            print(f"| {dtype} | {size} | {g:.1f} | {s:.1f} | {g / s:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    mp.start_processes(rank_main, args=(args, port, f"pagoda-bench-{uuid.uuid4().hex[:12]}", ctx.Event()),
                       nprocs=args.ranks, start_method="spawn")


if __name__ == "__main__":
    main()

"""What a shared-memory transport could buy on one host: a table.

dp_plugin's engines move bytes between the processes of one host through
Gloo's loopback TCP (gloo, horovod) or MPICH's shared memory (mpi). This
probe times, for 2 processes on this host, one all-reduce of the same
float32 buffer done two ways:

- ``gloo``: ``torch.distributed.all_reduce`` on a Gloo group (what the gloo
  engine and DDP use);
- ``shm``: the simplest all-reduce through a shared-memory segment, written
  here for the measurement only (no dp_plugin engine uses it): each process
  copies its buffer into its own slot, sums its half of the slots into a
  result slot, and copies the result back, with a barrier between phases.

It is a probe of the transport's cost, not an engine: no timeouts beyond the
barrier's, no asynchrony, two processes only.

    python benchmarks/shm_transport_probe.py [--numel 7460000] [--reps 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing import shared_memory
from typing import Any

from dp_plugin.cli.jobs import free_port

WORKERS = 2
TIMEOUT_S = 60.0


def shm_worker(rank: int, name: str, numel: int, reps: int, barrier: Any, out: Any) -> None:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    shm = shared_memory.SharedMemory(name=name)
    slots = torch.from_numpy(np.ndarray((WORKERS + 1, numel), dtype=np.float32, buffer=shm.buf))
    x = torch.full((numel,), float(rank + 1))
    lo, hi = rank * numel // WORKERS, (rank + 1) * numel // WORKERS
    times = []
    for _ in range(reps):
        x.fill_(float(rank + 1))
        barrier.wait(TIMEOUT_S)
        t0 = time.perf_counter()
        slots[rank].copy_(x)
        barrier.wait(TIMEOUT_S)
        torch.add(slots[0, lo:hi], slots[1, lo:hi], out=slots[WORKERS, lo:hi])
        barrier.wait(TIMEOUT_S)
        x.copy_(slots[WORKERS])
        times.append(time.perf_counter() - t0)
        barrier.wait(TIMEOUT_S)  # nobody refills a slot another still reads
    if not bool((x == 3.0).all()):
        raise AssertionError(f"rank {rank}: shm all-reduce gave {x[:4]}, expected 3.0")
    del slots
    shm.close()
    out.put(("shm", rank, times))


def gloo_worker(rank: int, port: int, numel: int, reps: int, out: Any) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORKERS, timeout=timedelta(seconds=TIMEOUT_S))
    x = torch.empty(numel)
    times = []
    for _ in range(reps):
        x.fill_(float(rank + 1))
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    if not bool((x == 3.0).all()):
        raise AssertionError(f"rank {rank}: gloo all-reduce gave {x[:4]}, expected 3.0")
    dist.destroy_process_group()
    out.put(("gloo", rank, times))


def run(ctx: Any, target: Any, args: tuple[Any, ...], out: Any) -> list[float]:
    """Start the workers, wait for all (bounded), check every exit code;
    returns rank 0's times."""
    procs = [ctx.Process(target=target, args=(rank, *args, out)) for rank in range(WORKERS)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S * 3
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    if codes != [0] * WORKERS:
        raise SystemExit(f"{target.__name__} failed or hung: exit codes {codes}")
    results = [out.get(timeout=TIMEOUT_S) for _ in range(WORKERS)]
    return next(times for _, rank, times in results if rank == 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=7_460_000,
                        help="float32 elements (default: the BERT-like encoder's gradient)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if args.numel < WORKERS or args.reps < 1:
        raise SystemExit(f"--numel must be >= {WORKERS} and --reps >= 1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    shm = shared_memory.SharedMemory(create=True, size=(WORKERS + 1) * args.numel * 4)
    try:
        shm_times = run(ctx, shm_worker, (shm.name, args.numel, args.reps, ctx.Barrier(WORKERS)),
                        out)
    finally:
        shm.close()
        shm.unlink()
    gloo_times = run(ctx, gloo_worker, (free_port(), args.numel, args.reps), out)
    mib = args.numel * 4 / 2**20
    print(f"all-reduce of {args.numel} float32 ({mib:.1f} MiB), {WORKERS} processes, "
          f"{args.reps} repetitions, rank 0's times")
    print(f"{'transport':<10} {'median':>10} {'min':>10} {'busbw':>12}")
    for label, times in (("gloo", gloo_times), ("shm", shm_times)):
        med = statistics.median(times)
        busbw = args.numel * 4 / med / 1e9  # 2(n-1)/n = 1 for n = 2
        print(f"{label:<10} {med * 1e3:>8.2f} ms {min(times) * 1e3:>7.2f} ms {busbw:>8.2f} GB/s")


if __name__ == "__main__":
    main()

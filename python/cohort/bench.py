"""Allreduce from Python, timed as ``cohort-worker bench`` times it, beside it in one run.

``python -m cohort.bench --ranks 2 --sizes 4K,16M --iters 200 --rounds 3`` starts a
coordinator and N rank processes of this module. Each rank joins a job (``cohort.Group``),
and for every size runs warm-up and timed iterations: fill the buffer, barrier, time one
``Communicator.allreduce`` (in place on a float32 NumPy array), barrier, verify every element
(the second barrier keeps one rank's verification out of another's timed call). A rank
reports its median; a size's figure is the slowest rank's median (the nccl-tests convention,
as the Rust bench). Each round runs ``cohort-worker bench`` with the same arguments and then
the Python ranks, so both see the same machine; the last lines compare them:

    ratio bytes=B python_us=P rust_us=R overhead_us=P-R python_vs_rust=P/R

(medians over the rounds). ``--no-rust`` times Python alone. ``--bind auto`` (the default)
binds rank r to the r-th allowed CPU when the ranks do not outnumber the CPUs, in both the
Rust and the Python ranks, as ``cohort-worker bench --bind auto`` does; ``--bind none`` leaves
both to the scheduler. Binaries come from ``$COHORT_BIN_DIR``, else target/release of the
checkout.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional


def parse_sizes(text: str) -> list[int]:
    """``4K,64K,1M,16M`` or plain byte counts (K, M, G are powers of 1024)."""
    sizes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(part[-1].upper(), 1)
        sizes.append(int(part[:-1] if mult > 1 else part) * mult)
    return sizes


def bin_dir() -> Path:
    if os.environ.get("COHORT_BIN_DIR"):
        return Path(os.environ["COHORT_BIN_DIR"])
    return Path(__file__).resolve().parents[2] / "target" / "release"


def bind_rank(rank: int, ranks: int) -> None:
    """Binds this process to the ``rank``-th allowed CPU when ``ranks`` fit one CPU each (the
    Rust bench's ``--bind auto``). Done before the extension starts any thread, so that its
    threads inherit the binding."""
    cpus = sorted(os.sched_getaffinity(0))
    if ranks <= len(cpus):
        os.sched_setaffinity(0, {cpus[rank]})


def rank_main(coordinator: str, job: str, rank_name: str, sizes: list[int], iters: int, warmup: int) -> None:
    """One rank: join, then time every size; prints ``result bytes=B median_us=T``."""
    import numpy as np

    import cohort

    group = cohort.Group(cohort.GroupConfig(job, coordinator, rank_name))
    comm = group.next_generation()
    world = comm.size
    for size in sizes:
        buf = np.zeros(size // 4, dtype=np.float32)
        times = []
        for it in range(warmup + iters):
            value = (it % 7) + 1
            buf.fill(value * (comm.rank + 1))
            comm.barrier()
            started = time.perf_counter()
            comm.allreduce(buf)
            took = time.perf_counter() - started
            comm.barrier()
            want = value * world * (world + 1) / 2
            if buf.size and not (buf[0] == want and (buf == want).all()):
                raise SystemExit(f"WRONG RESULT at {size} bytes, iteration {it}")
            if it >= warmup:
                times.append(took * 1e6)
        times.sort()
        print(f"result bytes={size} median_us={times[len(times) // 2]:.2f}", flush=True)
    comm.close()
    group.leave(finished=True)


def run_python(ranks: int, sizes_arg: str, iters: int, warmup: int, timeout: float, bind: str) -> dict[int, float]:
    """Starts a coordinator and the rank processes; returns bytes -> slowest rank's median."""
    coord = subprocess.Popen(
        [
            str(bin_dir() / "cohort-coordinator"),
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--min-workers",
            str(ranks),
            "--max-workers",
            str(ranks),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        seen = []
        m = None
        while m is None and len(seen) < 100 and coord.stdout:
            line = coord.stdout.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(r"listening on (\S+)", line)
        if m is None:
            raise SystemExit("the coordinator did not start: " + "".join(seen))
        endpoint = f"http://{m.group(1)}"
        job = f"bench-{os.getpid()}-{time.monotonic_ns()}"
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "cohort.bench",
                    "--rank-of",
                    endpoint,
                    job,
                    f"r{r}",
                    "--sizes",
                    sizes_arg,
                    "--iters",
                    str(iters),
                    "--warmup",
                    str(warmup),
                    "--ranks",
                    str(ranks),
                    "--bind",
                    bind,
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(ranks)
        ]
        medians: dict[int, float] = {}
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise SystemExit(f"a rank failed ({p.returncode}): {out}")
            for b, t in re.findall(r"result bytes=(\d+) median_us=([\d.]+)", out):
                medians[int(b)] = max(medians.get(int(b), 0.0), float(t))
        return medians
    finally:
        coord.kill()
        coord.wait(timeout=10)


def run_rust(ranks: int, sizes_arg: str, iters: int, warmup: int, timeout: float, bind: str) -> dict[int, float]:
    out = subprocess.run(
        [
            str(bin_dir() / "cohort-worker"),
            "bench",
            "--ranks",
            str(ranks),
            "--sizes",
            sizes_arg,
            "--iters",
            str(iters),
            "--warmup",
            str(warmup),
            "--dtype",
            "f32",
            "--bind",
            bind,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    ).stdout
    return {
        int(b): float(t) for b, t in re.findall(r"^peer=cohort ranks=\d+ bytes=(\d+) median_us=([\d.]+)", out, re.M)
    }


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m cohort.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="4K,16M")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="alternate Rust and Python this many times")
    ap.add_argument("--no-rust", action="store_true", help="time Python only")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument(
        "--bind",
        choices=["auto", "none"],
        default="auto",
        help="auto: one CPU per rank when they fit, for Rust and Python alike",
    )
    ap.add_argument("--rank-of", nargs=3, metavar=("COORDINATOR", "JOB", "NAME"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = parse_sizes(args.sizes)
    if args.rank_of:
        if args.bind == "auto":
            bind_rank(int(args.rank_of[2].lstrip("r")), args.ranks)
        rank_main(*args.rank_of, sizes=sizes, iters=args.iters, warmup=args.warmup)
        return
    py_rounds: list[dict[int, float]] = []
    rust_rounds: list[dict[int, float]] = []
    for _ in range(max(1, args.rounds)):
        if not args.no_rust:
            rust_rounds.append(run_rust(args.ranks, args.sizes, args.iters, args.warmup, args.timeout, args.bind))
        py_rounds.append(run_python(args.ranks, args.sizes, args.iters, args.warmup, args.timeout, args.bind))
    for size in sizes:
        py = statistics.median(r[size] for r in py_rounds)
        busbw = size / (py * 1e-6) / 1e9 * (2 * (args.ranks - 1) / args.ranks if args.ranks > 1 else 1)
        print(f"peer=cohort-python ranks={args.ranks} bytes={size} median_us={py:.1f} busbw_GBps={busbw:.3f}")
        if rust_rounds:
            rust = statistics.median(r[size] for r in rust_rounds)
            print(
                f"ratio bytes={size} python_us={py:.1f} rust_us={rust:.1f} overhead_us={py - rust:.1f} "
                f"python_vs_rust={py / rust:.3f}"
            )


if __name__ == "__main__":
    main()

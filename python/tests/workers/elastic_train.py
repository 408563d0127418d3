"""An elastic training loop in Python on the cohort package, speaking the event protocol of
`cohort-worker train` (one `event=KIND key=value ... t_ms=T` line per event on stdout, printed
through `cohort.events`, whose keys are the Rust definitions'), so that cohort-chaos runs it
with every invariant (scenario `python-kills`).

Each step averages a float64 gradient whose elements depend on the element, the step and the
rank, and whose average over any world is the same, so the expected parameters after step s
are known whatever re-formations happened: every rank checks every element of the reduced
gradient and of its parameters at every step. A wrong restore, a wrong sync, a lost or
repeated step, or blocks swapped in the allreduce all change them.

    g[r, i, t] = f(i, t) + (r - (n - 1) / 2) * h(i, t)     (exact in float64; the mean is f)

A mismatch prints `event=wrong_params` (then `fatal`); `finished` carries `params_digest` and
`expected_digest` (SHA-256 of the float64 parameters' bytes), which cohort-chaos compares across
the workers that finished.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import numpy as np

import cohort
from cohort.events import emit


def f(idx: np.ndarray, step: int) -> np.ndarray:
    return ((idx * 131 + step * 31) % 97).astype(np.float64)


def h(idx: np.ndarray, step: int) -> np.ndarray:
    return (((idx * 7 + step) % 5) + 1).astype(np.float64)


def expected_params(idx: np.ndarray, steps: int) -> np.ndarray:
    """The parameters after `steps` steps: the sum of f over t < steps. f(i, t) runs through
    every residue mod 97 once per 97 steps (31 is invertible mod 97), 0 + ... + 96 = 4656."""
    total = np.full(idx.size, (steps // 97) * 4656.0)
    for t in range(steps % 97):
        total += f(idx, t)
    return total


def digest(values: np.ndarray) -> str:
    """SHA-256 of the parameters' bytes, as `cohort-worker train` prints `params_digest`."""
    return hashlib.sha256(values.tobytes()).hexdigest()


def first_difference(params: np.ndarray, expected: np.ndarray) -> int:
    return int(np.flatnonzero(params != expected)[0])


def emit_summary(
    verified: int, step: int, failures: list[int], reforms: int, left: bool, params: np.ndarray, idx: np.ndarray
) -> None:
    emit(
        "summary",
        verified_steps=verified,
        final_step=step,
        failures=len(failures),
        lost_ms=",".join(str(x) for x in failures) or "-",
        cooperative_reforms=reforms,
        left=left,
        params_digest=digest(params),
        expected_digest=digest(expected_params(idx, step)),
    )


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def kind_of(e: cohort.CollectiveError) -> str:
    return {
        "PeerFailedError": "PeerFailed",
        "TimeoutError": "Timeout",
        "RevokedError": "Revoked",
        "TransportError": "Transport",
    }.get(type(e).__name__, type(e).__name__)


def cause_of(e: cohort.CollectiveError) -> str:
    return str(e.cause) if e.cause is not None else e.reason


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--worker-id", required=True)
    ap.add_argument("--listen", default="0.0.0.0:0")
    ap.add_argument("--advertise", default="127.0.0.1")
    ap.add_argument("--token-file")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--size", default="256K")
    ap.add_argument("--no-progress-ms", type=int, default=10000)
    ap.add_argument("--step-interval-ms", type=int, default=0)
    args = ap.parse_args()
    token = open(args.token_file).read().strip() if args.token_file else None
    count = max(1, parse_size(args.size) // 8)
    idx = np.arange(count, dtype=np.int64)

    emit("joining", worker=args.worker_id)
    try:
        group = cohort.Group(
            args.job,
            args.coordinator,
            args.worker_id,
            token=token,
            listen=args.listen,
            advertise=args.advertise,
            no_progress_timeout=args.no_progress_ms / 1000,
        )
    except cohort.GracefulLeave:
        emit("leave", gen=0, step=0, joined=False)
        return 0
    emit("joined", worker=args.worker_id, incarnation=group.incarnation, addr=group.address)
    # This loop has commit points (it reads `group.leaving` at each): SIGTERM leaves there, or
    # between generations (`next_generation` raises `GracefulLeave`), never inside a collective.
    group.leave_at_commit_points()

    params = np.zeros(count, dtype=np.float64)
    grad = np.empty(count, dtype=np.float64)
    checkpoint = cohort.Checkpoint()
    verified, failures, reforms = 0, [], 0
    failed_at = None
    last_generation = 0
    while True:
        try:
            comm = group.next_generation()
        except cohort.JobEndedError as e:
            if e.outcome == "finished":
                emit("job_ended", outcome="finished", reason=e.reason)
                break
            raise
        except cohort.GracefulLeave:
            # SIGTERM between generations (after a re-formation's break, waiting at the
            # rendezvous): the group has left the job; leave with the last commit's parameters,
            # as `cohort-worker train` does.
            step = checkpoint.step or 0
            if checkpoint.step is not None:
                params = np.frombuffer(checkpoint.snapshot(), dtype=np.float64).copy()
            emit(
                "leave",
                gen=last_generation,
                step=step,
                params_digest=digest(params),
                expected_digest=digest(expected_params(idx, step)),
                joined=False,
            )
            emit_summary(verified, step, failures, reforms, True, params, idx)
            return 0
        g, world, rank = comm.generation, comm.size, comm.rank
        last_generation = g
        emit("generation", gen=g, world=world, rank=rank, transport=comm.transport)
        try:
            state, outcome = checkpoint.sync(comm, params.tobytes())
        except cohort.CollectiveError as e:
            emit("error", gen=g, rank=rank, phase="sync", kind=kind_of(e), cause=cause_of(e))
            failed_at = failed_at or time.monotonic()
            continue
        params = np.frombuffer(state, dtype=np.float64).copy() if state else np.zeros(count)
        step = outcome.step or 0
        expected = expected_params(idx, step)
        emit(
            "restored",
            gen=g,
            rank=rank,
            step=outcome.step if outcome.step is not None else -1,
            source=outcome.source,
            changed=outcome.changed,
        )
        if not np.array_equal(params, expected):
            j = first_difference(params, expected)
            emit(
                "wrong_params", gen=g, rank=rank, step=step, phase="sync", index=j, got=params[j], expected=expected[j]
            )
            emit("fatal", error=f"parameters after the sync are not those of step {step}")
            return 1
        while True:
            if step >= args.steps:
                emit(
                    "finished",
                    gen=g,
                    rank=rank,
                    step=step,
                    params_digest=digest(params),
                    expected_digest=digest(expected_params(idx, step)),
                )
                group.leave(finished=True)
                emit_summary(verified, step, failures, reforms, False, params, idx)
                return 0
            grad[:] = f(idx, step) + (rank - (world - 1) / 2) * h(idx, step)
            started = time.monotonic()
            emit("allreduce", gen=g, rank=rank, step=step)
            try:
                comm.allreduce(grad, "avg")
            except cohort.CollectiveError as e:
                emit("error", gen=g, rank=rank, step=step, kind=kind_of(e), detail=e.message, cause=cause_of(e))
                if checkpoint.step is not None:
                    params = np.frombuffer(checkpoint.snapshot(), dtype=np.float64).copy()
                failed_at = failed_at or time.monotonic()
                break
            want = f(idx, step)
            bad = np.flatnonzero(grad != want)
            if bad.size:
                j = int(bad[0])
                emit("wrong_result", gen=g, rank=rank, step=step, index=j, got=grad[j], expected=want[j])
                return 1
            params += grad
            expected += want
            step += 1
            checkpoint.commit(params.tobytes(), step)
            verified += 1
            if failed_at is not None:
                lost = int((time.monotonic() - failed_at) * 1000)
                failures.append(lost)
                emit("recovered", gen=g, rank=rank, step=step, lost_ms=lost)
                failed_at = None
            emit("step", gen=g, world=world, rank=rank, step=step, ms=f"{(time.monotonic() - started) * 1e3:.3f}")
            if not np.array_equal(params, expected):
                j = first_difference(params, expected)
                emit(
                    "wrong_params",
                    gen=g,
                    rank=rank,
                    step=step,
                    phase="commit",
                    index=j,
                    got=params[j],
                    expected=expected[j],
                )
                emit("fatal", error=f"parameters at step {step} differ from the expected ones")
                return 1
            pending = group.commit(g, step, checkpoint.digest)
            flags = np.array([pending, group.leaving], dtype=np.uint8)
            try:
                comm.allreduce(flags, "max")
            except cohort.CollectiveError as e:
                emit("error", gen=g, rank=rank, step=step, phase="commit", kind=kind_of(e), cause=cause_of(e))
                failed_at = failed_at or time.monotonic()
                break
            if flags[1] and group.leaving:
                emit("leave", gen=g, rank=rank, step=step)
                comm.close()
                group.leave(finished=False)
                emit_summary(verified, step, failures, reforms, True, params, idx)
                return 0
            if flags[0] or flags[1]:
                emit("reform", gen=g, rank=rank, step=step, reason="leave" if flags[1] else "scale_up")
                reforms += 1
                break
            if args.step_interval_ms:
                time.sleep(args.step_interval_ms / 1000)  # pacing of the demo job, not synchronisation
        comm.close()
    emit_summary(verified, checkpoint.step or 0, failures, reforms, False, params, idx)
    return 0


if __name__ == "__main__":
    sys.exit(main())

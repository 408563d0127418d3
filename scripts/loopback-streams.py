#!/usr/bin/env python3
"""Two concurrent loopback TCP streams that move whole messages of a given size.

`compare.sh`'s loopback limit is iperf3's: each stream sends one 128 KiB buffer over and over,
so its data stay in the sender's and the receiver's caches. A 2-rank allreduce of 16 MiB sends
and receives 16 MiB of distinct memory each way. This script times that: each of two senders
sends its own `size`-byte buffer `reps` times (one `sendall` each), each receiver receives
into its own `size`-byte buffer, and it prints each stream's rate:

    python3 scripts/loopback-streams.py 16777216 120
    size=16777216 reps=120 GBps_each=2.31,2.54

Standard library only. Loopback (127.0.0.1) only; ports are taken from the kernel.
"""

import argparse
import multiprocessing as mp
import socket
import time

BUFFER = 4 << 20  # SO_SNDBUF / SO_RCVBUF: cohort's TCP transport asks for 4 MiB


def receive(listener: socket.socket, size: int, reps: int) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
    view = memoryview(bytearray(size))
    for _ in range(reps):
        got = 0
        while got < size:
            n = conn.recv_into(view[got:], size - got)
            if n == 0:
                raise ConnectionError("sender closed early")
            got += n
    conn.sendall(b"k")


def send(port: int, size: int, reps: int, rates: "mp.Queue[float]") -> None:
    conn = socket.create_connection(("127.0.0.1", port), timeout=120)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = bytearray(size)
    for i in range(0, size, 4096):  # touch every page before timing
        data[i] = i & 0xFF
    started = time.perf_counter()
    for _ in range(reps):
        conn.sendall(data)
    if conn.recv(1) != b"k":
        raise ConnectionError("receiver did not confirm")
    rates.put(size * reps / (time.perf_counter() - started) / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("size", type=int, help="bytes per message")
    parser.add_argument("reps", type=int, help="messages per stream")
    args = parser.parse_args()
    rates: mp.Queue[float] = mp.Queue()
    listeners = []
    for _ in range(2):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listeners.append(listener)
    receivers = [mp.Process(target=receive, args=(lst, args.size, args.reps)) for lst in listeners]
    senders = [
        mp.Process(target=send, args=(lst.getsockname()[1], args.size, args.reps, rates)) for lst in listeners
    ]
    for p in receivers + senders:
        p.start()
    for p in senders + receivers:
        p.join(timeout=300)
        if p.exitcode != 0:
            raise SystemExit(f"a stream failed (exit code {p.exitcode})")
    each = sorted(rates.get(timeout=5) for _ in senders)
    print(f"size={args.size} reps={args.reps} GBps_each={','.join(f'{r:.2f}' for r in each)}")


if __name__ == "__main__":
    main()

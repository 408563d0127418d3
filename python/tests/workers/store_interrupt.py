"""Waits on a cohort.torch.Store key that never comes (``store_interrupt.py ENDPOINT JOB
TOKEN``) until SIGINT: prints ``interrupted after S s`` when Ctrl-C's KeyboardInterrupt ends
the wait."""

import sys
import time
from datetime import timedelta

import cohort.torch

endpoint, job, token = sys.argv[1:4]
store = cohort.torch.Store(job, endpoint, token=token, scope="interrupt", timeout=timedelta(minutes=5))
started = time.monotonic()
try:
    print("waiting", flush=True)
    store.get("never")
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - started:.1f} s", flush=True)
    sys.exit(0)
print("the wait ended without the key or an interrupt", flush=True)
sys.exit(1)

"""examples/pytorch/hsdp_ft.py with this rank's first join of the cross-replica job held back
until the file GATE exists, as a slow pod's would be: the cross generation forms without it, so
the rest of its replica group is incomplete there and waits in the per-step agreement until
the next formation admits the whole group.

argv: GATE, then hsdp_ft.py's own arguments.
"""

import runpy
import sys
import time
from pathlib import Path

import cohort.hsdp

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pytorch" / "hsdp_ft.py"
gate = Path(sys.argv.pop(1))
held = True
real_group = cohort.hsdp.Group


def late_group(config, *args, **kwargs):
    global held
    if config.job.endswith(cohort.hsdp.CROSS_SUFFIX) and held:
        deadline = time.monotonic() + 120
        while not gate.exists():  # the test opens the gate once the others formed without us
            if time.monotonic() > deadline:
                raise TimeoutError(f"{gate} did not appear within 120 s")
            time.sleep(0.01)
        held = False
    return real_group(config, *args, **kwargs)


cohort.hsdp.Group = late_group
sys.argv[0] = str(EXAMPLE)
runpy.run_path(str(EXAMPLE), run_name="__main__")

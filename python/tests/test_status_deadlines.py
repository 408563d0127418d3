"""A Python worker reports the no-progress deadlines in force on its links, as
`cohort-worker train` does: the library reports them at every commit point, and
`cohort-coordinator status` shows them for each member."""

import json
import subprocess
import time

from conftest import binary


def test_python_workers_report_their_deadlines_to_status(coordinator_factory, spawn, tmp_path):
    coord = coordinator_factory(2)
    stop = tmp_path / "stop"
    workers = [
        spawn(f"w{r}", "commit_loop.py", coord.endpoint, "status-deadlines", f"w{r}", str(stop)) for r in range(2)
    ]
    try:
        for w in workers:
            w.wait_for_line(r"^committed 5$", timeout=60)
        # The progress goes with the next heartbeat: poll status, bounded.
        deadline, members = time.monotonic() + 20, []
        while time.monotonic() < deadline:
            out = subprocess.run(
                [str(binary("cohort-coordinator")), "status", "--json", "--job", "status-deadlines"]
                + ["--endpoints", coord.endpoint],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout
            members = json.loads(out)["members"]
            if len(members) == 2 and all(m["deadlines"] for m in members):
                break
            time.sleep(0.1)  # polling the coordinator's view, bounded by the deadline above
        assert len(members) == 2 and all(m["deadlines"] for m in members), members
        for m in members:
            # "250 ms floor", or a range and several bases ("250-480 ms floor/learned").
            value, unit, bases = m["deadlines"].split()
            assert unit == "ms" and value.replace("-", "").isdigit(), m
            assert set(bases.split("/")) <= {"floor", "learned", "ceiling", "fixed", "unlearned"}, m
    finally:
        stop.touch()
    for w in workers:
        assert w.wait(timeout=30) == 0, w.output()

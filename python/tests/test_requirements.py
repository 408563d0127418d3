"""What the suite does when torch is missing: skips by default, fails under
COHORT_REQUIRE_PYTHON (which scripts/test.sh sets, so that CI never passes with the PyTorch
tests silently skipped). A nested pytest runs test_training.py in a fresh interpreter in
which `import torch` raises ImportError."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# `sys.modules["torch"] = None` makes every `import torch` raise ImportError, as on a machine
# without torch, whatever is installed here.
WITHOUT_TORCH = (
    "import sys; sys.modules['torch'] = None; import pytest; "
    "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', sys.argv[1]]))"
)


def collect_without_torch(require: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COHORT_REQUIRE_PYTHON"}
    if require:
        env["COHORT_REQUIRE_PYTHON"] = "1"
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, str(TESTS / "test_training.py")],
        env=env,
        cwd=str(TESTS),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_missing_torch_skips_by_default():
    r = collect_without_torch(require=False)
    # 5: pytest's "no tests collected" (the module skipped itself), not a failure.
    assert r.returncode in (0, 5) and "1 skipped" in r.stdout, (r.returncode, r.stdout, r.stderr)


def test_missing_torch_fails_when_python_is_required():
    r = collect_without_torch(require=True)
    assert r.returncode != 0, (r.returncode, r.stdout, r.stderr)
    assert "torch" in r.stdout and "skipped" not in r.stdout, r.stdout

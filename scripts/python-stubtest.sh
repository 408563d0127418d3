#!/usr/bin/env bash
# Checks the stub python/cohort/_native.pyi against the built extension with mypy's stubtest:
# the same names in the module and in each class, the same signatures (parameters, kinds,
# defaults), classes that cannot be subclassed marked @final. Entries it may not compare are in
# python/stubtest/allowlist.txt, each with its reason.
#
#   bash scripts/python-stubtest.sh [PYTHON]
#
# PYTHON is the interpreter of the environment holding the built package (default: the one
# scripts/python-env.sh makes, target/pyenv/bin/python). mypy is pinned (MYPY_VERSION) and
# installed into that environment with pip the first time or when the pin changes.
set -euo pipefail
cd "$(dirname "$0")/.."
MYPY_VERSION=1.20.2
py=${1:-target/pyenv/bin/python}
[ -x "$py" ] || { echo "python-stubtest: no interpreter at $py (run scripts/python-env.sh)" >&2; exit 2; }
if [ "$("$py" -m mypy --version 2>/dev/null | awk '{print $2}')" != "$MYPY_VERSION" ]; then
  echo "python-stubtest: installing mypy $MYPY_VERSION" >&2
  "$py" -m pip install -q --disable-pip-version-check --retries 10 --timeout 60 --no-input "mypy==$MYPY_VERSION"
fi
# mypy reads the stub from python/ (MYPYPATH: not from wherever the package is installed), and
# stubtest imports the extension from the environment.
MYPYPATH="$PWD/python" "$py" -m mypy.stubtest cohort._native --allowlist python/stubtest/allowlist.txt

#!/usr/bin/env bash
# Builds cohort's Python package (python/, a PyO3 extension built by maturin) into the virtual
# environment target/pyenv and prints the interpreter's path on the last line.
#
#   bash scripts/python-env.sh            # release build (what benchmarks and CI use)
#   COHORT_PY_PROFILE=debug bash scripts/python-env.sh
#
# The venv is made by Debian's /usr/bin/python3 with --system-site-packages, so it sees
# Debian's python3-torch (1.13), python3-numpy, python3-sklearn and python3-pytest (installed
# by scripts/ensure-deps.sh). `maturin develop` builds in the workspace's target/ (shared with
# cargo) and installs the package in editable mode: python/cohort/*.py are used in place.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/pyenv
profile=${COHORT_PY_PROFILE:-release}
if [ ! -x "$venv/bin/python" ]; then
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
if ! "$venv/bin/python" -m maturin --version >/dev/null 2>&1; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --retries 10 --timeout 60 'maturin>=1.7,<2'
fi
args=(develop -m python/Cargo.toml --locked)
[ "$profile" = release ] && args+=(--release)
VIRTUAL_ENV="$PWD/$venv" PATH="$PWD/$venv/bin:$PATH" "$venv/bin/python" -m maturin "${args[@]}" >&2
"$venv/bin/python" -c 'import cohort._native' >&2
echo "$PWD/$venv/bin/python"

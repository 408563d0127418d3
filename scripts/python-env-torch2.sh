#!/usr/bin/env bash
# Makes the virtual environment target/pyenv-torch2: PyPI's torch 2.x (the version pinned below)
# beside Debian's Python packages, holding the same cohort package as target/pyenv, and prints
# the interpreter's path on the last line.
#
#   bash scripts/python-env.sh && bash scripts/python-env-torch2.sh
#
# - The venv is made by Debian's /usr/bin/python3 with --system-site-packages (NumPy, pytest and
#   scikit-learn are Debian's, as in target/pyenv); the torch installed in the venv comes first
#   on sys.path and hides Debian's python3-torch (1.13).
# - PyPI serves no CPU-only torch for Linux: its wheel pulls about 3 GB of CUDA packages (4.6 GB
#   installed), which the CPU backend never loads but torch's import needs. They are downloaded
#   once into a wheelhouse (target/wheelhouse, or $COHORT_WHEELHOUSE to share one between
#   checkouts on one machine) and installed from it, offline, whenever the venv is remade.
# - The cohort package is the checkout's python/ (a .pth file), with the extension that
#   scripts/python-env.sh built there (abi3: one build serves both interpreters), so both venvs
#   always run the same code.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/pyenv-torch2
torch_version=${COHORT_TORCH2_VERSION:-2.15.0}
wheels=${COHORT_WHEELHOUSE:-$PWD/target/wheelhouse}

have_torch() {
  "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" \
    >/dev/null 2>&1
}

if ! have_torch; then
  rm -rf "$venv"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  mkdir -p "$wheels"
  # Files already in the wheelhouse are not downloaded again. The download crosses the network
  # (about 3 GB): pip retries each request itself, and a failed resolution or download (a reset
  # connection, a registry's 5xx) is tried again whole, up to three times, before giving up.
  tries=0
  until "$venv/bin/python" -m pip download -q --disable-pip-version-check --retries 10 --timeout 60 \
    -d "$wheels" "torch==$torch_version" >&2; do
    tries=$((tries + 1))
    if [ "$tries" -ge 3 ]; then
      echo "downloading torch $torch_version failed $tries times; giving up" >&2
      exit 1
    fi
    echo "downloading torch $torch_version failed (try $tries of 3); trying again in $((tries * 20)) s" >&2
    sleep $((tries * 20))
  done
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-index --find-links "$wheels" \
    "torch==$torch_version" >&2
  have_torch || { echo "torch $torch_version did not install into $venv" >&2; exit 1; }
fi
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD/python" >"$site/cohort-checkout.pth"
if ! ls python/cohort/_native*.so >/dev/null 2>&1; then
  echo "python/cohort has no built extension: run scripts/python-env.sh first" >&2
  exit 1
fi
"$venv/bin/python" -c 'import cohort._native, cohort.torch, torch; assert torch.__version__.startswith("2.")' >&2
echo "$PWD/$venv/bin/python"

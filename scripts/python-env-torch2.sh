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
# - PyPI serves no CPU-only torch for Linux: its wheel pulls about 3 GB of CUDA packages (about
#   4 GB installed), which the CPU backend never calls but torch's import links. The install is
#   made to need little more disk than what it leaves: pip resolves the set first (metadata
#   only), then each wheel is downloaded and installed alone, pinned to the resolved URL and
#   hash, with no pip cache (the cache alone would keep another 3 GB). Made once per checkout.
# - Triton is left out: it is torch.compile's GPU code generator (1 GB), which a CPU process
#   never imports; torch imports it lazily and runs without it.
# - The cohort package is the checkout's python/ (a .pth file), with the extension that
#   scripts/python-env.sh built there (abi3: one build serves both interpreters), so both venvs
#   always run the same code.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/pyenv-torch2
torch_version=${COHORT_TORCH2_VERSION:-2.15.0}
# Resolved but not installed (see above).
left_out='^triton$'

have_torch() {
  "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" \
    >/dev/null 2>&1
}

# Runs "$@" up to three times: the downloads cross the network (pip retries each request
# itself; a reset connection or a registry's 5xx that outlasts that is tried again whole).
with_retries() {
  local tries=0
  until "$@" >&2; do
    tries=$((tries + 1))
    if [ "$tries" -ge 3 ]; then
      echo "failed $tries times, giving up: $*" >&2
      return 1
    fi
    echo "failed (try $tries of 3); trying again in $((tries * 20)) s: $*" >&2
    sleep $((tries * 20))
  done
}

if ! have_torch; then
  rm -rf "$venv"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-cache-dir)
  echo "installing torch $torch_version into $venv; disk before: $(df -h --output=avail . | tail -n 1 | tr -d ' ') free" >&2
  report=$(mktemp)
  trap 'rm -f "$report"' EXIT
  with_retries "${pip[@]}" install -q --retries 10 --timeout 60 --dry-run --report "$report" \
    "torch==$torch_version"
  # One line per wheel to install: the name, then its URL with the hash pip checks.
  wheels=$("$venv/bin/python" - "$report" <<'PY'
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    info = item["download_info"]
    hashes = info.get("archive_info", {}).get("hashes", {})
    url = info["url"] + (f"#sha256={hashes['sha256']}" if "sha256" in hashes else "")
    print(item["metadata"]["name"].lower(), url)
PY
)
  while read -r name url; do
    if [[ $name =~ $left_out ]]; then
      continue
    fi
    with_retries "${pip[@]}" install -q --retries 10 --timeout 60 --no-deps "$url"
  done <<<"$wheels"
  have_torch || { echo "torch $torch_version did not install into $venv" >&2; exit 1; }
  echo "torch $torch_version installed; disk after: $(df -h --output=avail . | tail -n 1 | tr -d ' ') free" >&2
fi
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$site/cohort-checkout.pth" # a new file, never one shared through a hard link with another checkout
echo "$PWD/python" >"$site/cohort-checkout.pth"
if ! ls python/cohort/_native*.so >/dev/null 2>&1; then
  echo "python/cohort has no built extension: run scripts/python-env.sh first" >&2
  exit 1
fi
"$venv/bin/python" -c 'import cohort._native, cohort.torch, torch; assert torch.__version__.startswith("2.")' >&2
echo "$PWD/$venv/bin/python"

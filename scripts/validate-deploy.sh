#!/usr/bin/env bash
# Offline validation of the Kubernetes deployment in deploy/:
#   1. yamllint over every YAML file in deploy/ (config: deploy/.yamllint);
#   2. `kubectl kustomize` renders deploy/base and every deploy/overlays/*;
#   3. kubernetes-validate checks every rendered resource against the Kubernetes 1.32
#      schemas, strictly (unknown fields are errors; a kind without a schema is an error);
#   4. deploy/validate/check_manifests.py checks that the resources fit together
#      (selectors, ports, references, pod hardening, etcd/coordinator wiring, job sizing),
#      and, when cohort-coordinator and cohort-worker are built under target/, that every
#      CLI flag in the manifests is one the binaries accept;
#   5. the packages and binaries deploy/Dockerfile builds exist in the Cargo workspace.
#
# yamllint and kubernetes-validate (pinned versions) are installed with pip into a virtual
# environment at .venv-deploy/ the first time (override with COHORT_DEPLOY_VENV); after that
# everything runs offline. kubectl must be on PATH (kubectl 1.32 ships kustomize 5.5).
# Exits non-zero on any problem and prints the file or resource that failed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEPLOY="$ROOT/deploy"
VENV="${COHORT_DEPLOY_VENV:-$ROOT/.venv-deploy}"
K8S_VERSION="1.32.0"
KUBERNETES_VALIDATE_VERSION="1.37.0"
YAMLLINT_VERSION="1.38.0"

fail() { echo "validate-deploy: $*" >&2; exit 1; }

# ---- tools ------------------------------------------------------------------------------
command -v kubectl >/dev/null 2>&1 \
  || fail "kubectl not found on PATH; install kubectl >= 1.27 (it renders the overlays with 'kubectl kustomize'). Nothing was installed."

if [ ! -x "$VENV/bin/kubernetes-validate" ] || [ ! -x "$VENV/bin/yamllint" ]; then
  command -v python3 >/dev/null 2>&1 || fail "python3 not found; it is needed for kubernetes-validate and yamllint"
  python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
    || fail "python3 >= 3.11 is needed (tomllib)"
  echo "validate-deploy: installing kubernetes-validate $KUBERNETES_VALIDATE_VERSION and yamllint $YAMLLINT_VERSION into $VENV"
  python3 -m venv "$VENV" || fail "cannot create a virtual environment at $VENV (Debian: apt-get install python3-venv)"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check \
    "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "yamllint==$YAMLLINT_VERSION" \
    || fail "pip could not install kubernetes-validate and yamllint into $VENV"
fi
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
  if ! kubectl kustomize "$target" >"$rendered" 2>"$TMP/kustomize.err"; then
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
else
  echo "   CLI flags not checked: no built cohort-coordinator and cohort-worker under target/"
fi

# ---- 5. Dockerfile build targets --------------------------------------------------------
echo "== deploy/Dockerfile"
if command -v cargo >/dev/null 2>&1; then
  if cargo metadata --manifest-path "$ROOT/Cargo.toml" --no-deps --offline --format-version 1 >"$TMP/meta.json" 2>"$TMP/meta.err"; then
    if ! "$PY" - "$DEPLOY/Dockerfile" "$TMP/meta.json" <<'PY'
import json, re, sys
dockerfile, meta = open(sys.argv[1]).read(), json.load(open(sys.argv[2]))
bins = {t["name"] for p in meta["packages"] for t in p["targets"] if "bin" in t["kind"]}
pkgs = {p["name"] for p in meta["packages"]}
bad = [f"package {p}" for p in re.findall(r"-p\s+([A-Za-z0-9_-]+)", dockerfile) if p not in pkgs]
bad += [f"binary {b}" for b in re.findall(r"--bin\s+([A-Za-z0-9_-]+)", dockerfile) if b not in bins]
for b in bad:
    print(f"deploy/Dockerfile builds {b}, which is not in the Cargo workspace")
sys.exit(1 if bad else 0)
PY
    then
      problem "deploy/Dockerfile names packages or binaries the workspace does not have"
    else
      echo "   cargo packages and binaries it builds exist in the workspace"
    fi
  else
    cat "$TMP/meta.err"
    problem "cargo metadata failed"
  fi
else
  echo "   skipped: cargo not on PATH"
fi

if [ "$status" -ne 0 ]; then
  echo "validate-deploy: FAILED"
  exit 1
fi
echo "validate-deploy: OK"

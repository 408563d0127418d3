#!/usr/bin/env bash
# The Python half of the style gate: ruff's linter and formatter over python/ and examples/,
# with the settings in python/pyproject.toml ([tool.ruff]).
#
#   bash scripts/python-lint.sh          check (scripts/test.sh's style gate): fails on a finding
#                                        or on a file ruff would reformat
#   bash scripts/python-lint.sh fix      apply ruff's fixes and formatting in place
#
# ruff is pinned (RUFF_VERSION below) and installed with pip into its own virtual environment,
# target/ruff-env, the first time or when the pin changes; it needs only python3 with venv,
# which scripts/ensure-deps.sh installs. No other Python package is involved: the check needs
# neither the extension nor torch.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF_VERSION=0.16.9
venv=target/ruff-env
mode=${1:-check}
case "$mode" in
  check|fix) ;;
  *) echo "python-lint: unknown argument '$mode' (check or fix)" >&2; exit 2 ;;
esac
if [ "$("$venv/bin/ruff" --version 2>/dev/null)" != "ruff $RUFF_VERSION" ]; then
  echo "python-lint: installing ruff $RUFF_VERSION into $venv" >&2
  rm -rf "$venv"
  mkdir -p target
  /usr/bin/python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --retries 10 --timeout 60 --no-input "ruff==$RUFF_VERSION"
fi
ruff=("$venv/bin/ruff")
config=(--config python/pyproject.toml)
paths=(python examples)
if [ "$mode" = fix ]; then
  "${ruff[@]}" check "${config[@]}" --fix "${paths[@]}"
  "${ruff[@]}" format "${config[@]}" "${paths[@]}"
else
  "${ruff[@]}" check "${config[@]}" "${paths[@]}"
  "${ruff[@]}" format "${config[@]}" --check "${paths[@]}"
fi

#!/usr/bin/env bash
# The test command (README.md). On a fresh Debian machine it installs what the build needs,
# then builds and runs every test of the workspace. Every test is bounded in time and starts
# and stops what it needs (etcd on a free loopback port, coordinators, worker processes).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/ensure-deps.sh

# Each part's heading says when it started and how long the run has taken so far, so that a
# CI log shows where the minutes go.
section() { echo "== $* [$(date -u +%H:%M:%S), ${SECONDS} s in]"; }

export CARGO_TERM_COLOR=never
export RUST_BACKTRACE=1
# No incremental compilation (as CI systems do): a test run builds each crate once, and the
# incremental caches would more than double target/debug's size. A cold run needs about 12 GB
# of disk: 6.5 GB for the builds, 4.4 GB for the torch 2.x venv. CARGO_INCREMENTAL=1 keeps them.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}

# The style gate: formatting (rustfmt.toml) and clippy with warnings as errors, the rdma
# feature included (the workspace lints are in Cargo.toml), the API docs with rustdoc's
# warnings as errors (a broken or private intra-doc link, an unclosed HTML tag), and ruff's
# lint and format check of python/ and examples/ (pinned in scripts/python-lint.sh, settings in
# python/pyproject.toml).
section "fmt, clippy and docs"
cargo fmt --all -- --check
bash scripts/python-lint.sh
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo clippy -p cohort -p cohort-transports -p cohort-worker --features cohort/rdma,cohort-worker/rdma --all-targets --locked -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked
RUSTDOCFLAGS="-D warnings" cargo doc -p cohort -p cohort-transports -p cohort-worker --features cohort/rdma,cohort-worker/rdma --no-deps --locked

section "build"
cargo build --workspace --all-targets --locked
# The coverage-guided fuzz targets (fuzz/, not a workspace member) must build; uninstrumented,
# into the workspace's target directory, so the dependencies built above are reused. Their
# seed corpus (fuzz/seeds/) is replayed by the tests below; `bash scripts/fuzz.sh` fuzzes.
cargo build --manifest-path fuzz/Cargo.toml --bins --locked --target-dir target

section "deploy manifests (kustomize render, offline schema validation, yamllint, CLI flags)"
bash scripts/validate-deploy.sh --require-cli

# The release binaries and the Python package (python/: the PyO3 extension and the
# pure-Python layers), built by maturin into target/pyenv (which sees Debian's torch): the
# Kubernetes rehearsal with Python pods, the quick suite's python-kills scenario and the pytest
# suite below run Python workers with it.
section "release build and the Python package"
cargo build --release --locked -p cohort-chaos -p cohort-worker -p cohort-coordinator
py=$(bash scripts/python-env.sh | tail -n 1)
export COHORT_PYTHON="$py"

# COHORT_REQUIRE_PYTHON: a test that needs the Python package fails instead of skipping;
# COHORT_REQUIRE_BROWSER: the status page's test fails instead of skipping without Chromium.
# Among the unit tests: the loom model check of the shared-memory ring's memory orderings
# (transports/src/shm/model.rs, the tests named loom_*; docs/testing.md), exhaustive, seconds.
section "tests"
COHORT_REQUIRE_PYTHON=1 COHORT_REQUIRE_BROWSER=1 cargo test --workspace --locked -- --test-threads="${COHORT_TEST_THREADS:-2}"
# The scale harness's smoke run: 96 members of the shipped worker (ElasticGroup, with the host
# relays) in two farm processes, on a real coordinator process, through every phase (formation,
# failure, re-formation, timed heartbeats naming a straggler, the finish).
cargo test -p cohort-coordinator --bench scale --locked

# The chaos suite, quick: real coordinator and worker processes (release build), every fault
# kind once (kills mid-allreduce, hangs, network faults through the proxy, coordinator and
# etcd loss, joins and leaves, below min_workers), every invariant checked.
section "chaos suite --quick"
target/release/cohort-chaos suite --quick --json target/chaos-quick.json

# README's main command, as a newcomer runs it: it fails unless its verdict is PASS.
section "the demo (README's main command)"
bash scripts/demo.sh

# The Python package's tests (the extension, the elastic layers, the PyTorch backend and
# example), against the release binaries: real coordinator and worker processes on loopback.
section "python"
# mypy's stubtest checks python/cohort/_native.pyi against the built extension (names,
# signatures, defaults, @final classes); python/stubtest/allowlist.txt lists what it skips, and why.
bash scripts/python-stubtest.sh "$py"
# COHORT_REQUIRE_PYTHON: a missing torch fails the PyTorch tests instead of skipping them.
# COHORT_TEST_WHOLE_ANSWER_UP_TO=1: every coordinator the tests start answers each generation
# of two or more members as a sparse view (python/tests/conftest.py), so every test that forms a
# group runs on the sparse path here; the torch 2.x pass below runs the default (whole answers)
# but for its sparse part (docs/testing.md, "Sparse views in the Python suite").
COHORT_TEST_WHOLE_ANSWER_UP_TO=1 COHORT_REQUIRE_PYTHON=1 COHORT_BIN_DIR="$PWD/target/release" \
  "$py" -m pytest -q -p no:cacheprovider python/tests

# The PyTorch tests again under PyPI's torch 2.x (the supported torch; Debian's 1.13 above keeps
# working): target/pyenv-torch2 holds the same cohort package. Made once per checkout
# (scripts/python-env-torch2.sh: about 3 GB downloaded, 4.4 GB installed).
section "python, torch 2.x (disk: $(df -h --output=avail . | tail -n 1 | tr -d ' ') free; target/ holds $(du -sh target | cut -f1))"
py2=$(bash scripts/python-env-torch2.sh | tail -n 1)
# COHORT_REQUIRE_PYTHON here too: every skip fails the pass unless the test declared itself not
# applicable (python/tests/conftest.py, not_applicable); under torch 2.x none is expected.
# Whole answers (the default) for these; sparse views for the torch-2.x-only tests (which the
# torch 1.13 pass above cannot run sparse): FSDP2 and HSDP there only (with their runs on the
# managed gloo group), the reconfigure and Ctrl-C tests again, and the 17-rank partial-view test
# on torch 2.x's backend class. test_managed.py's two-rank DDP kill, its misuse test and its exit test run
# here too; its three-rank kill and SIGSTOP tests (about 60 s under torch 2.x's slower imports) only in
# the torch 1.13 pass above: what they add is cohort's side (lease, revocation, re-formation),
# the same under both torches, while the torch-2.x paths (the Backend class, Work.wait raising)
# are run here by the two-rank kill, FSDP2 and HSDP.
COHORT_REQUIRE_PYTHON=1 COHORT_BIN_DIR="$PWD/target/release" "$py2" -m pytest -q -p no:cacheprovider \
  python/tests/test_torch_backend.py python/tests/test_training.py \
  python/tests/test_torch_p2p.py python/tests/test_signals.py python/tests/test_store.py \
  python/tests/test_managed.py::test_ddp_on_managed_gloo_survives_a_kill_mid_allreduce \
  python/tests/test_managed.py::test_misuse_is_refused_and_a_revoked_generation_raises_its_root_cause \
  python/tests/test_managed.py::test_a_rank_exiting_with_a_managed_call_in_flight_waits_for_it \
  python/tests/test_late_ranks.py::test_ddp_with_rank_0_checkpointing_for_a_minute_between_steps
COHORT_TEST_WHOLE_ANSWER_UP_TO=1 COHORT_REQUIRE_PYTHON=1 COHORT_BIN_DIR="$PWD/target/release" \
  "$py2" -m pytest -q -p no:cacheprovider \
  python/tests/test_fsdp2.py python/tests/test_hsdp.py python/tests/test_sparse_views.py \
  python/tests/test_torch_backend.py::test_reconfigure_binds_the_world_to_a_replacement_generation \
  python/tests/test_signals.py::test_ctrl_c_interrupts_torch_distributed_all_reduce
# torch 2.11's path, under torch 2.15 (about 40 s): where torch binds no constructor for
# c10d.Backend the backends are process groups (cohort.torch.PYTHON_BACKEND is False);
# COHORT_TORCH_AS_PROCESS_GROUP=1 takes that path here (docs/python.md, "torch versions").
COHORT_TORCH_AS_PROCESS_GROUP=1 COHORT_REQUIRE_PYTHON=1 COHORT_BIN_DIR="$PWD/target/release" \
  "$py2" -m pytest -q -p no:cacheprovider \
  python/tests/test_torch_backend.py::test_every_torch_distributed_call_matches_the_local_answer \
  python/tests/test_torch_p2p.py

# The RDMA transport (feature `rdma`): its device-free tests run everywhere; the device
# tests run when a device is present and otherwise say, visibly, that they were skipped.
section "rdma feature"
cargo build -p cohort-worker --features rdma --bins --locked
rdma_log=$(mktemp)
# The transports' tests, then the worker library's unit tests that only exist with the
# feature (mesh choice, group endpoint set-up).
if ! { cargo test -p cohort-transports --features rdma --locked -- --nocapture --test-threads=2 &&
       cargo test -p cohort --features rdma --lib --locked -- --nocapture --test-threads=2; } >"$rdma_log" 2>&1; then
  cat "$rdma_log"; exit 1
fi
grep -E '^test result|SKIPPED|RDMA devices present' "$rdma_log"
rm -f "$rdma_log"
section "all passed"

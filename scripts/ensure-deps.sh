#!/usr/bin/env bash
# Installs, through apt-get, the system packages cohort needs, when missing. Idempotent: does
# nothing when everything is present.
#
#   bash scripts/ensure-deps.sh          everything the tests need (scripts/test.sh)
#   bash scripts/ensure-deps.sh build    only what building the binaries needs (scripts/demo.sh)
#
# build:  gcc, libc6-dev        a C toolchain (build scripts of ring, libc, ... compile C)
#         protobuf-compiler     protoc, for tonic-prost-build and etcd-client's build script
#         libprotobuf-dev       google/protobuf/*.proto, which etcd-client's protos import
# test:   etcd-server           the real etcd the store and coordinator tests start on loopback
#         libibverbs-dev, librdmacm-dev, libclang-dev, clang   rdma-sys (feature `rdma`)
#         openssl               certificates for the TLS tests
#         iproute2              network namespaces (chaos `netns` scenario)
#         python3-venv          the Python package's venv and the Kubernetes schema validator
#         python3-numpy, python3-torch, python3-sklearn, python3-pytest
#                               the Python package's tests and the PyTorch example (Debian's
#                               torch 1.13; a venv with --system-site-packages sees it)
#         chromium              the status page's test opens the page in headless Chromium
# Runs apt-get as root, or through sudo; without either it prints the command to run and fails.
set -euo pipefail
what=${1:-test}

need=()
command -v cc >/dev/null 2>&1 || need+=(gcc)
[ -e /usr/include/stdio.h ] || need+=(libc6-dev)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
[ -e /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
if [ "$what" = test ]; then
  command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
  [ -e /usr/include/infiniband/verbs.h ] || need+=(libibverbs-dev)
  [ -e /usr/include/rdma/rdma_cma.h ] || need+=(librdmacm-dev)
  # libclang itself (bindgen loads libclang.so); libclang-cpp, which the image may carry, is not it.
  ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need+=(libclang-dev clang)
  command -v openssl >/dev/null 2>&1 || need+=(openssl)
  command -v ip >/dev/null 2>&1 || need+=(iproute2)
  /usr/bin/python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
  /usr/bin/python3 -c 'import numpy' >/dev/null 2>&1 || need+=(python3-numpy)
  /usr/bin/python3 -c 'import torch' >/dev/null 2>&1 || need+=(python3-torch)
  /usr/bin/python3 -c 'import sklearn' >/dev/null 2>&1 || need+=(python3-sklearn)
  /usr/bin/python3 -c 'import pytest' >/dev/null 2>&1 || need+=(python3-pytest)
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
elif [ "$what" != build ]; then
  echo "ensure-deps: unknown argument '$what' (build or test)" >&2
  exit 2
fi

if [ ${#need[@]} -eq 0 ]; then
  echo "ensure-deps: all system packages present"
  exit 0
fi
echo "ensure-deps: installing ${need[*]}"
if [ "$(id -u)" -eq 0 ]; then
  run=()
elif command -v sudo >/dev/null 2>&1; then
  run=(sudo)
else
  echo "ensure-deps: not root and no sudo; as root, run:" >&2
  echo "  apt-get update && apt-get install -y --no-install-recommends ${need[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${run[@]}" apt-get update -qq
"${run[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}"

#!/usr/bin/env bash
# Installs, through apt-get, the system packages cohort's build and tests need, when missing:
#   protobuf-compiler  protoc, for tonic-prost-build and etcd-client's build script
#   libprotobuf-dev    google/protobuf/*.proto, which etcd-client's protos import (protoc
#                      alone, installed without recommends, lacks them)
#   etcd-server        the real etcd the store and coordinator tests start on loopback
#   libibverbs-dev, librdmacm-dev, libclang-dev, clang   rdma-sys (feature `rdma`)
#   python3-venv       the offline Kubernetes schema validator (scripts/validate-deploy.sh)
# Idempotent: does nothing when everything is present.
set -euo pipefail

need=()
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
[ -e /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
[ -e /usr/include/infiniband/verbs.h ] || need+=(libibverbs-dev)
[ -e /usr/include/rdma/rdma_cma.h ] || need+=(librdmacm-dev)
# libclang itself (bindgen loads libclang.so); libclang-cpp, which the image may carry, is not it.
ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need+=(libclang-dev clang)

if [ ${#need[@]} -gt 0 ]; then
  echo "ensure-deps: installing ${need[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
else
  echo "ensure-deps: all system packages present"
fi

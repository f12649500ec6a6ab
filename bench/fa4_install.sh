#!/usr/bin/env bash
# FlashAttention-4 (flash_attn.cute) on a GPU machine that cannot reach a package index, from
# wheels carried in two calls (one call carries at most 64 MiB; the CUDA 13 libraries' wheel alone
# is 92 MB, split in two with `split -b 46000000`):
#
#   .fa4a/cu13.part.aa                          carried by a first call:   bash bench/fa4_install.sh stash
#   .fa4b/cu13.part.ab, cu13.sha256, the other  carried by a second call:  bash bench/fa4_install.sh install
#   wheels (flash-attn-4, nvidia-cutlass-dsl and its libs-base and libs-core, quack-kernels,
#   apache-tvm-ffi, torch-c-dlpack-ext)
#
# `install` puts the packages in /tmp/fa4 (pip --target, no dependencies resolved: torch is the
# machine's own); bench/landing.sh puts /tmp/fa4 and its dsl_packages folder on PYTHONPATH where
# it exists (a --target folder's .pth files are not read).
set -euo pipefail
cd "$(dirname "$0")/.."
parts=/tmp/fa4-parts
case "${1:-}" in
stash)
    mkdir -p "$parts" && cp .fa4a/cu13.part.aa "$parts"/ && ls -la "$parts"
    ;;
install)
    cp .fa4b/cu13.part.ab "$parts"/
    wheel=$parts/$(ls .fa4b | grep -m1 'nvidia_cutlass_dsl_libs_base' | sed 's/libs_base/libs_cu13/')
    cat "$parts"/cu13.part.aa "$parts"/cu13.part.ab > "$wheel"
    echo "$(cut -d' ' -f1 .fa4b/cu13.sha256)  $wheel" | sha256sum -c -
    python3 -m pip install -q --no-deps --target /tmp/fa4 "$wheel" .fa4b/*.whl
    PYTHONPATH=/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages python3 -c "import flash_attn.cute; print('flash_attn.cute imports')"
    ;;
*)
    echo "usage: bash bench/fa4_install.sh stash|install" >&2
    exit 2
    ;;
esac

#!/bin/sh
# launch_sites.sh DIR: every kernel launch of the CUDA backend's op files in DIR goes through
# cuda_launch (kernels/cuda/cuda_internal.h), which logs it while a graph segment is open; a
# raw <<<...>>> launch would run ahead of the logged work. numfmt_cuda.cu is outside the
# backend (its own entries, no backend state). Exit 0: none; 1: the offending lines printed.
# With --self-test: the check run on a copy with a raw launch added must fail.
set -u
if [ "${1:-}" = "--self-test" ]; then
    dir=$(mktemp -d) || exit 2
    trap 'rm -rf "$dir"' EXIT
    cp "$2"/*.cu "$dir"/ || exit 2
    printf 'static void f(cudaStream_t s) { k<<<1, 32, 0, s>>>(); }\n' >> "$dir/rmsnorm.cu"
    if sh "$0" "$dir" > /dev/null; then
        echo "FAIL: a raw launch added to rmsnorm.cu was not found"
        exit 1
    fi
    echo "a raw launch added to rmsnorm.cu is found"
    exit 0
fi
dir=${1:?usage: launch_sites.sh DIR | --self-test DIR}
bad=$(grep -n '<<<' "$dir"/*.cu | grep -v '/numfmt_cuda\.cu:' | grep -v '^[^:]*:[0-9]*: *\(/\*\|\*\)')
if [ -n "$bad" ]; then
    echo "raw kernel launches (use cuda_launch):"
    echo "$bad"
    exit 1
fi
echo "every launch in $dir goes through cuda_launch"

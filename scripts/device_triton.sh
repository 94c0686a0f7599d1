#!/usr/bin/env bash
# Stage a newer Triton on the GPU machine (its image has 3.6; Gluon's cluster launches and TMA multicast need >= 3.9)
# in two 28 MB parts that fit beside the working tree in a call (see DEVELOPERS.md):
#   scripts/device_triton.sh [VERSION]      (default: the local .venv's Triton)
# Downloads the CPython 3.12 wheel (the machine's Python; a 3.11 build segfaults on import there), drops what a
# Hopper run never loads (the AMD backend, CUPTI, proton, nvdisasm, the pre-sm_90 ptxas: for sm_90 Triton >= 3.9
# assembles with `ptxas-blackwell`, CUDA 13.x), strips libtriton's symbols, packs it with xz (~56 MB from 286) and
# splits it into .device-stage/t0 and t1. Prints the sha256 and the calls.
set -euo pipefail
py=.venv/bin/python
ver=${1:-$($py -c "import triton; print(triton.__version__)")}
tmp=$(mktemp -d)
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_28_x86_64 -d "$tmp/whl" "triton==$ver"
mkdir -p "$tmp/site" && (cd "$tmp/site" && unzip -q "$tmp"/whl/*.whl)
t="$tmp/site/triton"
rm -rf "$t/backends/amd" "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/lib/cupti-blackwell" \
  "$t/backends/nvidia/bin/nvdisasm" "$t/_C/libproton.so" "$t/backends/nvidia/bin/ptxas"
ln -s ptxas-blackwell "$t/backends/nvidia/bin/ptxas"
strip --strip-unneeded "$t/_C/libtriton.so"
tar -cf - -C "$tmp/site" . | xz -6 -T2 > "$tmp/triton.tar.xz"
sum=$(sha256sum "$tmp/triton.tar.xz" | cut -d' ' -f1)
rm -rf .device-stage/t0 .device-stage/t1 && mkdir -p .device-stage/t0 .device-stage/t1
split -n 2 -d -a 1 "$tmp/triton.tar.xz" "$tmp/tpart_"
mv "$tmp/tpart_0" .device-stage/t0/ && mv "$tmp/tpart_1" .device-stage/t1/
rm -rf "$tmp"
cat <<EOF
triton $ver for the GPU machine: sha256 $sum, 2 parts. Calls, back to back (each within ~30 s of the last):
 1. carry [".whl"]: mkdir -p /tmp/pl && source scripts/device_env.sh
 2. carry [".device-stage/t0"]: cp .device-stage/t0/tpart_0 /tmp/pl/
 3. carry [".device-stage/t1"]: cp .device-stage/t1/tpart_1 /tmp/pl/ && cat /tmp/pl/tpart_0 /tmp/pl/tpart_1 > /tmp/triton.tar.xz \\
      && echo "$sum  /tmp/triton.tar.xz" | sha256sum -c - && mkdir -p /tmp/triton-new && tar -xJf /tmp/triton.tar.xz -C /tmp/triton-new; \\
      source scripts/device_env.sh; PYTHONPATH=/tmp/triton-new:\$PYTHONPATH TRITON_BACKENDS_IN_TREE=1 TRITON_CACHE_DIR=/tmp/tc-new <your command>
    (TRITON_BACKENDS_IN_TREE=1: the image's Triton 3.6 also advertises the AMD backend by entry point, which the
    staged copy lacks. torch stays the image's; only Triton-language and Gluon kernels use the staged Triton.)
EOF

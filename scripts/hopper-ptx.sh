#!/usr/bin/env bash
# The Hopper kernels' PTX (core's GEMMs: `hopper_ptx`; burn-sage's attention: `sage_ptx`),
# compiled here without a GPU, through
# NVIDIA's `ptxas` for sm_90a: registers, spills, and the warpgroup-MMA waits of each kernel.
#   scripts/hopper-ptx.sh [OUT_DIR]      (default target/hopper-ptx)
# A wait of 0 groups in the main loop drains the tensor cores at that stage; the consumers' main
# loop should wait with one group in flight (`wgmma.wait_group 1`) at every stage of a round.
# ptxas and libdevice come from PyPI wheels (nvidia-cuda-nvcc, nvidia-nvvm 13.0.88: the CUDA 13.0
# of the GPU machines' driver), unpacked once under .cache/cuda-tools.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/hopper-ptx}
tools=.cache/cuda-tools
if [ ! -x "$tools/nvidia/cu13/bin/ptxas" ] || [ ! -f "$tools/nvidia/cu13/nvvm/libdevice/libdevice.10.bc" ]; then
  mkdir -p "$tools/wheels"
  python3 -m pip download --quiet --no-deps -d "$tools/wheels" \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88
  for w in "$tools"/wheels/*.whl; do python3 -m zipfile -e "$w" "$tools"; done
  chmod +x "$tools/nvidia/cu13/bin/ptxas"
fi
# CUDA_PATH only for the run (libdevice): set for the build, it would rebuild the CUDA crates.
target=${CARGO_TARGET_DIR:-/work/target-cuda}
rm -f "$out"/*.ptx "$out"/*.cubin
CARGO_TARGET_DIR=$target cargo build --quiet -p burn-kernels-core -p burn-sage --features ptx-dump \
  --example hopper_ptx --example sage_ptx
for tool in hopper_ptx sage_ptx; do
  CUDA_PATH=$PWD/$tools/nvidia/cu13 "$target/debug/examples/$tool" "$out" >/dev/null
done
for ptx in "$out"/*.ptx; do
  name=$(basename "$ptx" .ptx)
  info=$("$tools/nvidia/cu13/bin/ptxas" -arch=sm_90a -v -o "$out/$name.cubin" "$ptx" 2>&1 \
    | grep -E "Used|spill" | tr -s ' ' | tr '\n' ' ')
  waits=$(grep -o 'wgmma.wait_group.sync.aligned[[:space:]]*[0-9]' "$ptx" | awk '{print $2}' \
    | sort | uniq -c | awk '{printf "%s×%s ", $1, $2}')
  echo "$name: waits (count×groups in flight) ${waits}| $info"
done

#!/usr/bin/env bash
# TorchRec and fbgemm-gpu for a lent GPU machine, in parts small enough to carry (issues #32, #33).
#
#   bash benchmarks/gpu_torchrec_bundle.sh [OUT_DIR]     # default .fbx (git-ignored); 5-10 min on 2 cores (zstd -19 over 2.4 GB)
#
# Why a script: the GPU image has torch 2.11.0+cu130 and Lightning but neither TorchRec nor fbgemm-gpu,
# nothing on it can reach an index, and one call carries at most 64 MiB. fbgemm-gpu 1.6.0 is the build
# for torch 2.11 and CUDA 13 (its libraries need libcudart.so.13); its wheel is 465 MB, but its kernels
# repeat per GPU architecture, so zstd's long window packs the package into 163 MB: three parts of at
# most 56 MiB. TorchRec 1.6.1 goes with it: the CPU pin (1.9.2) imports fbgemm-gpu >= 1.8's Python API
# (fbgemm_gpu.tbe.ssd's KVZCHParams, ...). How the parts travel and are unpacked: benchmarks/README.md
# ("GPU check", "TorchRec on the GPU").
set -euo pipefail
out=${1:-.fbx}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$tmp" fbgemm-gpu==1.6.0 torchrec==1.6.1 tensordict==0.15.3 \
  iopath==0.1.9 "pyvers==0.2.3"
mkdir -p "$tmp/pkg" "$out"
unzip -q "$tmp"/fbgemm_gpu-1.6.0-*.whl -d "$tmp/pkg"
tar -C "$tmp/pkg" -cf - . | zstd -q -19 -T0 --long=27 -o "$tmp/fbgemm.tar.zst"
zstd -q -t --long=27 "$tmp/fbgemm.tar.zst"
split -b 56M -d -a 2 "$tmp/fbgemm.tar.zst" "$out/part"
cp "$tmp"/torchrec-*.whl "$tmp"/tensordict-*.whl "$tmp"/iopath-*.whl "$tmp"/pyvers-*.whl "$(command -v zstd)" "$out/"
ls -l "$out"

#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, torch 2.11 + CUDA 13, no network there), as
# session 12 staged them for `benchmarks/gpu_suite.sh` (issue 20: xnn itself, cuEquivariance,
# mace-torch, torch-sim 0.6.2, nvalchemi-toolkit 0.2.0). One device call carries at most
# 64 MiB with the working tree, so the wheels go into git-ignored folders of at most ~59 MiB:
#   .whl  xnn's dependencies, cuEquivariance (+ ops_torch_cu13), mace-torch, torch-sim,
#         nvalchemi and their small dependencies (and this script: `bash .whl/gpu_wheels.sh install`)
#   .wA .wB .wC  warp-lang's 149 MB wheel in three parts (+ tables, blosc2)
#   .wD   cuequivariance_ops_cu13 (45 MB) and botocore
# Here:  bash benchmarks/gpu_wheels.sh download       (echo /.whl/ /.wA/ ... >> .git/info/exclude)
# There: one call per big folder, carry [".wD"]: `bash -c 'mkdir -p /tmp/stage && cp .wD/* /tmp/stage/'`
#        (the same for .wA, .wB, .wC while the machine stays warm), then carry [".whl"]:
#        `bash .whl/gpu_wheels.sh install; export PYTHONPATH=/tmp/site:$PWD`.
# For xnn alone (neighbor lists, the equivariant model, triton) the small set of `download
# small` (.wS, 11 MB) is enough.
set -euo pipefail
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
SMALL=(ase==3.29.0 vesin==0.6.2 vesin-torch==0.6.2 omegaconf==2.4.0 antlr4-python3-runtime
       pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
       torch-pme tad-dftd3 tad-mctc==0.8.0 platformdirs)
PEERS=(cuequivariance==0.13.0 cuequivariance-torch==0.13.0 cuequivariance-ops-torch-cu13==0.13.0
       mace-torch==0.3.16 torch-ema==0.3 lmdb orjson matscipy opt_einsum_fx prettytable wcwidth
       configargparse gitpython gitdb smmap torch-sim-atomistic==0.6.2 nvalchemi-toolkit==0.2.0
       nvalchemi-toolkit-ops==0.5.0 dm-tree loguru periodictable==2.0.2 plotext plum-dispatch
       beartype tensordict "pyvers<0.3,>=0.2" "zarr>=3" donfig google-crc32c msgspec numcodecs
       nvidia-physicsnemo cftime hydra-core importlib-metadata s3fs "fsspec>=2026.4.0" termcolor
       treelib nvtx numexpr ndindex aiobotocore jmespath aioitertools)
WARP=warp_lang-1.19.0-py3-none-manylinux_2_28_x86_64.whl
case "${1:?download [small] | install}" in
download)
  if [ "${2:-}" = small ]; then
    mkdir -p .wS && python3 -m pip download "${PLAT[@]}" -d .wS "${SMALL[@]}"; exit; fi
  mkdir -p .whl .wA .wB .wC .wD /tmp/xnn-wheels
  python3 -m pip download "${PLAT[@]}" -d .whl "${SMALL[@]}" "${PEERS[@]}"
  python3 -m pip download "${PLAT[@]}" -d /tmp/xnn-wheels warp-lang==1.19.0 tables==3.11.1 \
      blosc2 cuequivariance-ops-cu13==0.13.0 botocore==1.43.117
  split -b 49800000 -d -a 2 /tmp/xnn-wheels/$WARP /tmp/xnn-wheels/warp.part
  sha256sum /tmp/xnn-wheels/$WARP | cut -c1-64 > .wC/warp.sha
  mv /tmp/xnn-wheels/warp.part00 /tmp/xnn-wheels/tables-*.whl .wA/
  mv /tmp/xnn-wheels/warp.part01 /tmp/xnn-wheels/blosc2-*.whl .wB/
  mv /tmp/xnn-wheels/warp.part02 .wC/
  mv /tmp/xnn-wheels/cuequivariance_ops_cu13-*.whl /tmp/xnn-wheels/botocore-*.whl .wD/
  cp "$0" .whl/gpu_wheels.sh
  du -sh .whl .wA .wB .wC .wD ;;
install)  # on the GPU machine, from the repository root
  W=/tmp/stage/$WARP
  if ls /tmp/stage/warp.part* >/dev/null 2>&1; then
    cat /tmp/stage/warp.part00 /tmp/stage/warp.part01 /tmp/stage/warp.part02 > "$W"
    rm /tmp/stage/warp.part*
    [ "$(sha256sum "$W" | cut -c1-64)" = "$(cat /tmp/stage/warp.sha)" ] || { echo "warp: bad sha"; rm -f "$W"; }
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl $(ls /tmp/stage/*.whl 2>/dev/null) 2>&1 \
      | grep -v -i "warning\|dependency\|requires" || true
  PYTHONPATH=/tmp/site python3 -c "import cuequivariance_ops_torch" 2>/dev/null \
      && echo "cuequivariance kernels: ok" || echo "cuequivariance kernels: NOT importable" ;;
esac

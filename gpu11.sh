#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl2/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run() { n=$1; lim=$2; shift 2; t0=$(date +%s); timeout $lim torchrun --nproc-per-node 2 benchmarks/training.py --device cuda --no-mace --steps 60 --models schnet "$@" --json $OUT/$n.json > /tmp/$n.log 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(grep -h 'DDP' /tmp/$n.log | tr '\n' ' ')"; }
run s_e_bb 50 --barrier-alone
run s_e 50
run s_e_bb2 50 --barrier-alone
run s_c_bb 75 --compile --barrier-alone

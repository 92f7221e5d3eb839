#!/usr/bin/env bash
# GPU benchmark suite as run on the device machine (H200s): `bash benchmarks/gpu_suite.sh PART OUTDIR`.
# Each step has its own time limit so that one slow step cannot take the whole run.
# Files land in OUTDIR under the names of the runs below; a result that becomes current is
# copied to benchmarks/results/<benchmark>_<device>.json (each script's --json default) with
# its command in benchmarks/results_commands.py, then `python benchmarks/results_tables.py`.
# PART 1: CUDA tests, neighbor lists, models, MD (1 GPU).
# PART 2: NCCL decomposed-vs-single validation and domain-decomposition scaling (2 GPUs).
# PART 3: training throughput, DDP efficiency (2 GPUs), equivariant memory ceiling (1 GPU).
# PART 5: matched-size equivariant vs MACE: auto chunking, compiled inference, memory ceiling (1 GPU).
# PART 6: NCCL check of the owned-only sync mode, largest system on 1 vs 2 GPUs, SevenNet-0 (2 GPUs).
# PART 8: issue 20 leftovers of session 11 (neighbor-list host overhead, peers' compiled steps).
# PART 9: model.kernel_backend=triton on 1 GPU: its CUDA tests, the fused operator against the
#         reference, kernel backends, compiled MD steps with it.
# PARTS 10-12: one device call each (1 GPU): the GPU tests of compiled training through the
#         fused convolution (10), the steps with the Verlet list filtered to the cutoff
#         against the whole list (11), the peers with the filter (12; they need the big
#         wheels, 10 and 11 the small set). Session 16 ran 11 with the reference kernels
#         and 12; still to run: 10 (after the symbolic-width fix) and 11's triton half
#         (KB=triton). pytest's plugin autoload is off: hydra's (in the big wheels) fails.
#         Session 17 ran 10 and 11 (KB=triton), then 13 and 14 (big wheels); session 18: 15;
#         sessions 19-20 prepared 16 and 17 (big wheels;
#         no GPU was lent to them: not yet run).
# PART 18: MACE's radial MLPs through the fused Triton kernel (xnn.models.triton_mlp): the
#         micro-benchmark against mace-torch's layers (tiling sweep), its GPU tests, the paired
#         MACE step's profile per _mace_pairs.RADIAL (torch, ieee, tf32x3: 18p); 18b: MACE at 10k
#         against torch-sim with tf32x3; 18c: the micro-benchmark under torch.compile (not yet run).
# PART 19 (session 22): 18's CUDA tests with 16's, the micro-benchmark; 19b: MACE at 10k against
#         torch-sim with each fusion x radial variant of the graph step in one run (VARIANTS=...).
# PART 23 (session 23): 23a 19c's repeat and the backward sweep; 23b the equivariant model's
#         fused radial kernel and the split step's profile; 23c the neighbor-list goal.
# PART 24a: 23c with the batched case and vesin after a torch op on the host's CPU.
# Wheels for the peers and cuEquivariance: benchmarks/gpu_wheels.sh.
# PART 7: issue 20 on 1 GPU: CUDA tests, paired neighbor lists, compiled steps, kernel backends,
#         peers (torch-sim 0.6.2, nvalchemi-toolkit 0.2.0: their wheels, warp-lang's 149 MB one
#         split in parts, travel in several calls and are installed with pip --target first).
set -u
PART=${1:?part}; OUT=${2:?outdir}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step() { local limit=$1 name=$2; shift 2; echo "=== $name ($(date +%T), limit ${limit}s)";
         timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "=== $name rc=$?"; tail -n 25 "$OUT/$name.log"; }
case "$PART" in
1)
  step 90 gpu_tests python3 -m pytest -q -m gpu tests/test_neighbors.py tests/test_schnet_painn.py -p no:cacheprovider
  step 100 neighbors python3 benchmarks/neighbors.py --device cuda --json "$OUT/neighbors_h200.json"
  step 170 models python3 benchmarks/models.py --device cuda --dtype float32 --json "$OUT/models_h200.json"
  step 150 md python3 benchmarks/md.py --device cuda --dtype float32 --json "$OUT/md_h200.json"
  ;;
2)
  python3 - <<'PY'
from ase.build import bulk
a = bulk("Cu", "fcc", a=3.61, cubic=True) * (10, 10, 10); a.rattle(0.05, seed=0); a.write("/tmp/cu4000.xyz")
b = a.copy(); b.set_cell(b.cell.array @ [[1, 0.3, 0.2], [0, 1, 0.25], [0, 0, 1]], scale_atoms=True); b.write("/tmp/cu_tri.xyz")
PY
  for spec in lj:sigma=2.3,epsilon=0.4,cutoff=5.0 painn equivariant sevenn:checkpoint=7net-0; do
    for s in /tmp/cu_tri.xyz; do
      step 60 "validate_${spec%%:*}_$(basename $s .xyz)" torchrun --nproc-per-node 2 -m xnn validate --model "$spec" \
        --structure "$s" --dtype float64 --device cuda --json "$OUT/validate_${spec%%:*}_$(basename $s .xyz).json"
    done
  done
  step 300 dd torchrun --nproc-per-node 2 benchmarks/dd.py --device cuda --models painn,equivariant,sevenn \
      --scaling both --json "$OUT/dd_h200x2.json"
  ;;
3)
  step 120 md python3 benchmarks/md.py --device cuda --dtype float32 --json "$OUT/md_h200.json"
  step 140 training python3 benchmarks/training.py --device cuda --json "$OUT/training_h200.json"
  step 90 training_ddp torchrun --nproc-per-node 2 benchmarks/training.py --device cuda --no-mace --json "$OUT/training_ddp_h200x2.json"
  step 210 dd_equivariant torchrun --nproc-per-node 2 benchmarks/dd.py --device cuda --models equivariant \
      --sizes 100000,1000000 --atoms-per-rank 250000 --repeat 3 --scaling both --json "$OUT/dd_equivariant_h200x2.json"
  ;;
4)
  python3 - <<'PY'
from ase.build import bulk
a = bulk("Cu", "fcc", a=3.61, cubic=True) * (4, 4, 4); a.rattle(0.05, seed=0)
a.set_cell(a.cell.array @ [[1, 0.3, 0.2], [0, 1, 0.25], [0, 0, 1]], scale_atoms=True); a.write("/tmp/cu256_tri.xyz")
PY
  step 150 md python3 benchmarks/md.py --device cuda --dtype float32 --json "$OUT/md_h200.json"
  step 90 validate_sevenn_cu256_tri torchrun --nproc-per-node 2 -m xnn validate --model sevenn:checkpoint=7net-0 \
      --structure /tmp/cu256_tri.xyz --dtype float64 --device cuda --json "$OUT/validate_sevenn_cu256_tri.json"
  step 200 dd_sevenn torchrun --nproc-per-node 2 benchmarks/dd.py --device cuda --models sevenn \
      --sizes 10000,40000 --atoms-per-rank 10000 --repeat 3 --scaling both --json "$OUT/dd_sevenn_h200x2.json"
  ;;
5)
  step 420 equivariant_vs_mace python3 -m benchmarks.bench_equivariant --device cuda --channels 128 \
      --cutoff 6 --sizes 10976 --chunks auto --compile --json "$OUT/equivariant_vs_mace_128ch_auto_h200.json"
  ;;
6)
  python3 - <<'PY'
from ase.build import bulk
a = bulk("Cu", "fcc", a=3.61, cubic=True) * (10, 10, 10); a.rattle(0.05, seed=0)
a.set_cell(a.cell.array @ [[1, 0.3, 0.2], [0, 1, 0.25], [0, 0, 1]], scale_atoms=True); a.write("/tmp/cu_tri.xyz")
PY
  [ -n "${SKIP_VALIDATE:-}" ] || step 60 validate_equivariant_sync torchrun --nproc-per-node 2 -m xnn validate --model equivariant --mode sync \
      --structure /tmp/cu_tri.xyz --dtype float64 --device cuda --json "$OUT/nccl_validate_equivariant_sync_cu_tri.json"
  step 270 dd_equivariant torchrun --nproc-per-node 2 benchmarks/dd.py --device cuda --models equivariant \
      --scaling none --find-max 250000 --timeout 120 \
      --json "$OUT/dd_equivariant_largest_h200x2.json"
  step 150 dd_sevenn torchrun --nproc-per-node 2 benchmarks/dd.py --device cuda --models sevenn \
      --sizes 20000,40000 --repeat 2 --scaling strong --timeout 120 \
      --json "$OUT/dd_sevenn_h200x2.json"
  ;;
7)
  step 150 gpu_tests python3 -m pytest -q -m gpu tests/test_kernel_backends.py tests/test_compiled_md.py \
      tests/test_compiled_cuda.py tests/test_neighbors.py -p no:cacheprovider -rA
  step 100 neighbors python3 benchmarks/neighbors.py --json "$OUT/neighbors_paired_h200.json" --paired-only \
      --devices cuda cpu --sizes 100000 1000000
  step 100 kernel python3 benchmarks/kernel_backends.py --device cuda --sizes 1000 10000 --mace \
      --json "$OUT/kernel_backends_h200.json"
  step 260 md_compiled python3 benchmarks/md_compiled.py --device cuda --dtype float32 --models equivariant \
      --ensembles nve,langevin --kernel-backends reference --n-atoms 10000 --steps 20 --json "$OUT/md_compiled_h200.json"
  step 250 peers python3 benchmarks/peers.py --device cuda --dtype float32 --sizes 1000,10000,100000 \
      --batched 64x100 --steps 9 --budget-s 90 --frameworks xnn,torch_sim,nvalchemi --json "$OUT/peers_h200.json"
  step 150 peers_cueq python3 benchmarks/peers.py --device cuda --dtype float32 --sizes 10000 --batched 64x100 \
      --models mace --steps 9 --budget-s 60 --frameworks xnn,torch_sim,nvalchemi --cueq --json "$OUT/peers_cueq_h200.json"
  ;;
8)  # issue 20, still to measure on one GPU (session 11 left these): host overhead and paired
    # neighbor lists with the whole-call cache, peers with the compiled Langevin step
  step 120 nl_host python3 benchmarks/neighbors.py --json "$OUT/neighbors_host_overhead_h200.json" \
      --host-overhead 2000 --devices cuda cpu --profile 20
  step 150 neighbors python3 benchmarks/neighbors.py --json "$OUT/neighbors_paired_h200.json" --paired-only \
      --phases --devices cuda cpu --sizes 100000 1000000
  step 400 peers_compiled python3 benchmarks/peers.py --device cuda --dtype float32 --sizes 10000 \
      --batched 64x100 --steps 9 --budget-s 120 --frameworks xnn,xnn_step_graph,torch_sim,torch_sim_compiled \
      --cueq --json "$OUT/peers_compiled_h200.json"
  ;;
9)  # model.kernel_backend=triton (xnn.models.triton_tp): GPU tests, the operator against the
    # reference at 479k edges (with the tiling sweep), kernel backends and the compiled step
  step 300 triton_tests python3 -m pytest -q -m gpu tests/test_triton_tp.py -p no:cacheprovider -rA
  step 300 triton_tp python3 benchmarks/triton_tp.py --device cuda --dtype float32 --sweep \
      --json "$OUT/triton_tp_h200.json"
  step 150 kernel_triton python3 benchmarks/kernel_backends.py --device cuda --sizes 1000 10000 \
      --backends reference,triton --json "$OUT/kernel_backends_triton_h200.json"
  step 300 md_compiled_triton python3 benchmarks/md_compiled.py --device cuda --dtype float32 \
      --models equivariant --ensembles nve --kernel-backends reference,triton --n-atoms 10000 \
      --steps 20 --json "$OUT/md_compiled_triton_h200.json"
  ;;
10) # the filtered Verlet list (3bc5d57 one process, d83ae58 decomposed), the fused convolution
    # in compiled training (491ef65), then the peers (MACE and the batched cells)
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  step 500 triton_gpu_tests python3 -m pytest -q -m gpu tests/test_triton_tp.py tests/test_compiled_cuda.py \
      -k "compiled_training or cuda_graph or model_triton or replay" -p no:cacheprovider -rA
  ;;
11)
  step 500 md_compiled_filter python3 benchmarks/md_compiled.py --device cuda --dtype float32 \
      --models equivariant --ensembles nve --kernel-backends "${KB:-reference,triton}" --n-atoms 10000 \
      --steps 20 --unfiltered --json "$OUT/md_compiled_filter_h200.json"
  ;;
12)
  step 400 peers_filter python3 benchmarks/peers.py --device cuda --dtype float32 --sizes 10000 \
      --batched 64x100 --steps 9 --budget-s 120 --frameworks xnn,xnn_step_graph,torch_sim \
      --cueq --json "$OUT/peers_filter_h200.json"
  ;;
13) # big wheels: the mace wrapper's cueq check, where the MACE step's time goes (kernel time
    # against wall time), nvalchemi (goal 1.3x) with the filtered list
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  step 120 mace_cueq_test python3 -m pytest -q -m gpu tests/test_kernel_backends.py -k mace_wrapper \
      -p no:cacheprovider -p no:logging --tb=long
  step 150 profile_mace_cueq python3 benchmarks/profile_compiled_step.py --model mace --kernel-backend cueq \
      --atoms 10000 --device cuda --rows 40
  step 280 peers_nvalchemi python3 benchmarks/peers.py --device cuda --dtype float32 --sizes 10000 \
      --batched none --models mace --steps 9 --budget-s 100 --frameworks xnn_step_graph,torch_sim,nvalchemi \
      --cueq --json "$OUT/peers_nvalchemi_filter_h200.json"
  ;;
14) # big wheels: the mace wrapper's cueq check after the species-table fix, the MACE profile
    # with whole kernel names, MACE at 10k against torch-sim with the eager force reference
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  step 120 mace_cueq_test python3 -m pytest -q -m gpu tests/test_kernel_backends.py -k mace_wrapper \
      -p no:cacheprovider -p no:logging -rA
  step 150 profile_mace_cueq python3 benchmarks/profile_compiled_step.py --model mace --kernel-backend cueq \
      --atoms 10000 --device cuda --rows 25
  step 300 peers_mace python3 benchmarks/peers.py --device cuda --dtype float32 --sizes 10000 \
      --batched none --models mace --steps 9 --budget-s 100 --frameworks xnn,xnn_step_graph,torch_sim \
      --cueq --json "$OUT/peers_mace_h200.json"
  ;;
15) # big wheels: MACE's radial MLPs once per edge pair in the compiled step (session 18):
    # the step profile per edge, with the half-size weights by index and concatenated,
    # then MACE at 10k against torch-sim with the eager (per-edge) force reference
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  for pairs in off index concat; do
    step 150 profile_mace_pairs_$pairs python3 benchmarks/profile_compiled_step.py --model mace \
        --kernel-backend cueq --atoms 10000 --device cuda --rows 25 --pairs $pairs
  done
  step 300 peers_mace_pairs python3 benchmarks/peers.py --device cuda --dtype float32 --sizes 10000 \
      --batched none --models mace --steps 9 --budget-s 100 --frameworks xnn,xnn_step_graph,torch_sim \
      --cueq --json "$OUT/peers_mace_pairs_h200.json"
  ;;
16) # big wheels (session 19): the paired MACE step with cuEquivariance's fused convolution
    # once per half of the edges (split) against one call reading the half-size weights by
    # index (session 18's, the default), and the CUDA test of every fusion mode
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  step 150 mace_pairs_cuda_test python3 -m pytest -q -m gpu tests/test_edge_pairs.py \
      -p no:cacheprovider -p no:logging -rA
  for pairs in split index; do
    step 150 profile_mace_pairs_$pairs python3 benchmarks/profile_compiled_step.py --model mace \
        --kernel-backend cueq --atoms 10000 --device cuda --rows 25 --pairs $pairs --index-dtype int64
  done
  ;;
16b) # the same with int32 indices (cuEquivariance's kernels sort them), and per edge
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  step 150 mace_pairs_cuda_test_int32 python3 -m pytest -q -m gpu tests/test_edge_pairs.py \
      -p no:cacheprovider -p no:logging -rA
  for pairs in split index off; do
    step 150 profile_mace_pairs_${pairs}_int32 python3 benchmarks/profile_compiled_step.py --model mace \
        --kernel-backend cueq --atoms 10000 --device cuda --rows 25 --pairs $pairs --index-dtype int32
  done
  ;;
17) # big wheels (session 19): MACE at 10k against torch-sim with the split fused convolution
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  step 300 peers_mace_split python3 benchmarks/peers.py --device cuda --dtype float32 --sizes 10000 \
      --batched none --models mace --steps 9 --budget-s 100 --frameworks xnn,xnn_step_graph,torch_sim \
      --cueq --mace-fusion split --json "$OUT/peers_mace_split_h200.json"
  ;;
18) # MACE's radial MLPs by the fused Triton kernel (xnn.models.triton_mlp), fp32 (ieee) or
    # 3xTF32 products, against mace-torch's e3nn layers: the micro-benchmark on the 428,070 edge
    # pairs of 10,976 Cu atoms at 6 A (errors against fp64, the tiling sweep cut at 75 s; it
    # takes the peers' MACE weights from mace-torch (.whl), or e3nn networks of the same shapes
    # without it) and the kernel's GPU tests (the small set is enough for these two)
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  step 180 triton_mlp python3 benchmarks/triton_mlp.py --device cuda --sweep --sweep-budget-s 75 \
      --json "$OUT/triton_mlp_h200.json"
  step 150 triton_mlp_tests python3 -m pytest -q -m gpu tests/test_triton_mlp.py \
      -p no:cacheprovider -p no:logging -rA
  ;;
18p) # big wheels: the paired compiled MACE step's profile per radial path (cuEquivariance),
    # then xnn's equivariant model (triton kernels) with and without the fused radial MLPs
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  for radial in torch ieee tf32x3; do
    step 150 profile_mace_radial_$radial python3 benchmarks/profile_compiled_step.py --model mace \
        --kernel-backend cueq --atoms 10000 --device cuda --rows 25 --pairs index --radial $radial
  done
  for radial in torch tf32x3; do
    step 150 profile_equivariant_radial_$radial python3 benchmarks/profile_compiled_step.py \
        --model equivariant --kernel-backend triton --atoms 10000 --device cuda --rows 25 \
        --radial $radial
  done
  ;;
18b) # big wheels: MACE at 10k against torch-sim with the radial MLPs by the 3xTF32 kernel (the
    # forces checked against the eager per-edge step's)
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  step 300 peers_mace_radial_tf32x3 python3 benchmarks/peers.py --device cuda --dtype float32 \
      --sizes 10000 --batched none --models mace --steps 9 --budget-s 100 \
      --frameworks xnn,xnn_step_graph,torch_sim --cueq --radial tf32x3 \
      --json "$OUT/peers_mace_radial_tf32x3_h200.json"
  ;;
18c) # the micro-benchmark of 18 with each variant's forward also under torch.compile (inductor's
    # GEMMs and fused pointwise kernels: the compiled step's torch baseline), without s
  step 300 triton_mlp_compiled python3 benchmarks/triton_mlp.py --device cuda --compile --scale off \
      --json "$OUT/triton_mlp_compiled_h200.json"
  ;;
19) # big wheels (session 22): the CUDA tests of the fused radial kernels and of every fusion
    # mode, and the radial micro-benchmark (no sweep)
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  step 200 cuda_tests_radial_fusion python3 -m pytest -q -m gpu tests/test_triton_mlp.py \
      tests/test_edge_pairs.py -p no:cacheprovider -p no:logging -rA
  step 150 triton_mlp python3 benchmarks/triton_mlp.py --device cuda --json "$OUT/triton_mlp_h200.json"
  ;;
19b) # big wheels (session 22): MACE at 10k against torch-sim, the CUDA-graph step once per
    # combination of the fused convolution's weights (index, split) and the radial path (torch
    # layers, 3xTF32 kernel), one run, one torch-sim reference
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  step 560 peers_mace_variants python3 benchmarks/peers.py --device cuda --dtype float32 \
      --sizes 10000 --batched none --models mace --steps 9 --budget-s 100 \
      --frameworks xnn,torch_sim --cueq --variants ${VARIANTS:-index+torch,split+torch,index+tf32x3,split+tf32x3} \
      --json "$OUT/peers_mace_variants_h200.json"
  ;;
19c) # big wheels (session 22): 19b showed eager MACE at 5k atom-steps/s with the indexed fusion
    # (the eager list is filtered to the cutoff every step, so the number of pairs changes);
    # eager with the split fusion, the graph step's best variants for MACE and the equivariant
    # model
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  step 300 peers_mace_split_variants python3 benchmarks/peers.py --device cuda --dtype float32 \
      --sizes 10000 --batched none --models mace --steps 9 --budget-s 90 \
      --frameworks xnn,torch_sim --cueq --mace-fusion split \
      --variants split+tf32x3,split+tf32x3+int32 \
      --json "$OUT/peers_mace_split_variants_h200.json"
  ;;
19e) # xnn's equivariant model at 10k with and without the fused radial MLPs (small set)
  step 250 peers_equivariant_radial python3 benchmarks/peers.py --device cuda --dtype float32 \
      --sizes 10000 --batched none --models equivariant --steps 9 --budget-s 90 \
      --frameworks xnn --cueq --variants split+torch,split+tf32x3 \
      --json "$OUT/peers_equivariant_radial_h200.json"
  ;;
19d) # big wheels: the tiling sweep of the fused radial kernels in 3xTF32 (with pipeline
    # stages) on MACE's widest network, then the profile of the fastest MACE step (session 22
    # ran the sweep alone, right after 19c; the profile is not yet run)
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  step 200 triton_mlp_sweep python3 benchmarks/triton_mlp.py --device cuda --blocks 1 --scale off \
      --sweep --sweep-precisions tf32x3 --sweep-budget-s 90 --repeat 10 \
      --json "$OUT/triton_mlp_sweep_h200.json"
  step 150 profile_mace_split_tf32x3 python3 benchmarks/profile_compiled_step.py --model mace \
      --kernel-backend cueq --atoms 10000 --device cuda --rows 30 --pairs split --radial tf32x3
  ;;
23a) # big wheels (session 23): 19c again on another machine (the 2.0x goal's repeat, with
    # the new forward tiling), then the backward kernel's tiling sweep in 3xTF32 (its block
    # table first takes about a minute; session 23 ran it with a 200 s limit, which cut it)
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  bash "$0" 19c "$OUT"
  step 260 triton_mlp_sweep_backward python3 benchmarks/triton_mlp.py --device cuda --blocks 1 \
      --scale off --sweep --sweep-parts backward --sweep-precisions tf32x3 --sweep-budget-s 150 \
      --repeat 10 --json "$OUT/triton_mlp_sweep_backward_h200.json"
  ;;
23b) # xnn's equivariant model at 10k with and without the fused radial MLPs (19e), then the
    # profile of the fastest MACE step (19d's second half)
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  bash "$0" 19e "$OUT"
  step 200 profile_mace_split_tf32x3 python3 benchmarks/profile_compiled_step.py --model mace \
      --kernel-backend cueq --atoms 10000 --device cuda --rows 30 --pairs split --radial tf32x3
  ;;
23c) # the neighbor-list goal again (CUDA and the host's CPU, 10^5 and 10^6 atoms, paired)
  step 150 neighbors python3 benchmarks/neighbors.py --json "$OUT/neighbors_paired_h200.json" --paired-only \
      --phases --devices cuda cpu --sizes 100000 1000000
  ;;
24a) # 23c, plus the batched case and vesin after a torch op on the host's CPU
  step 170 neighbors python3 benchmarks/neighbors.py --json "$OUT/neighbors_paired_h200.json" --paired-only \
      --phases --devices cuda cpu --sizes 100000 1000000 --batched 64 108
  step 90 after_torch_op python3 benchmarks/neighbors.py --json "$OUT/neighbors_after_torch_op_host.json" \
      --after-torch-op 30 --sizes 10000 100000
  ;;
esac

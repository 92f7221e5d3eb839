"""The command that made each file of ``benchmarks/results/`` (the file itself records the
device, the date and, for new files, the commit). Output paths are written out although they
are the scripts' defaults (``benchmarks.common.results_path``)."""

COMMANDS = {
    "bad_inputs_cpu.json": ("python scripts/bad_input_sweep.py --json "
                            "benchmarks/results/bad_inputs_cpu.json"),
    "gpu_suite_h100.txt": "python3 -m pytest -m gpu (benchmarks/gpu_suite.sh, one H100)",
    "neighbors_h200.json": ("python benchmarks/neighbors.py --device cuda --json "
                            "benchmarks/results/neighbors_h200.json"),
    "neighbors_cpu.json": ("python benchmarks/neighbors.py --repeat 3 --json "
                           "benchmarks/results/neighbors_cpu.json"),
    "neighbors_paired_h100.json": ("python benchmarks/neighbors.py --paired-only --phases "
                                   "--devices cuda cpu --sizes 100000 1000000 --batched 64 108 "
                                   "--json benchmarks/results/neighbors_paired_h100.json "
                                   "(gpu_suite.sh 24a)"),
    "neighbors_paired_h200.json": ("python benchmarks/neighbors.py --paired-only --devices cuda "
                                   "cpu --sizes 100000 1000000 --phases --json "
                                   "benchmarks/results/neighbors_paired_h200.json (gpu_suite.sh "
                                   "23c)"),
    "neighbors_paired_cpu.json": ("python benchmarks/neighbors.py --paired-only --devices cpu "
                                  "--sizes 10000 100000 1000000 --paired-rounds 15 --phases "
                                  "--batched 64 108 --json "
                                  "benchmarks/results/neighbors_paired_cpu.json"),
    "neighbors_after_torch_op_cpu16.json": ("python benchmarks/neighbors.py --after-torch-op 30 "
                                            "--sizes 10000 100000 --json "
                                            "benchmarks/results/neighbors_after_torch_op_cpu16.json"),
    "neighbors_after_torch_op_cpu.json": ("python benchmarks/neighbors.py --after-torch-op 60 "
                                          "--json "
                                          "benchmarks/results/neighbors_after_torch_op_cpu.json"),
    "models_h200.json": ("python benchmarks/models.py --device cuda --dtype float32 --json "
                         "benchmarks/results/models_h200.json"),
    "bench_equivariant_h200.json": ("python benchmarks/bench_equivariant.py --device cuda "
                                    "--channels 128 --cutoff 6 --sizes 10976 --chunks auto "
                                    "--compile --json "
                                    "benchmarks/results/bench_equivariant_h200.json"),
    "md_h200.json": ("python benchmarks/md.py --device cuda --dtype float32 --json "
                     "benchmarks/results/md_h200.json"),
    "md_mace_compiled_h200.json": ("python benchmarks/md.py --device cuda --dtype float32 --only "
                                   "mace --compile --sizes 1000,10000 --json "
                                   "benchmarks/results/md_mace_compiled_h200.json"),
    "md_cpu.json": ("python benchmarks/md.py --steps 10 --eq-sizes 1000,10000 --mace-sizes 1000 "
                    "--json benchmarks/results/md_cpu.json"),
    "md_batched_cpu.json": ("python benchmarks/md_batched.py --blocks 5 --n-small 108 --json "
                            "benchmarks/results/md_batched_cpu.json"),
    "md_compiled_h200.json": ("python benchmarks/md_compiled.py --device cuda --dtype float32 "
                              "--models equivariant --ensembles nve --kernel-backends triton "
                              "--n-atoms 10000 --steps 20 --unfiltered --json "
                              "benchmarks/results/md_compiled_h200.json (gpu_suite.sh 11, "
                              "KB=triton)"),
    "md_compiled_cpu.json": ("python benchmarks/md_compiled.py --models equivariant --dtype "
                             "float32 --json benchmarks/results/md_compiled_cpu.json"),
    "peers_h200.json": ("python benchmarks/peers.py --device cuda --dtype float32 --sizes 10000 "
                        "--batched none --models mace --steps 9 --budget-s 90 --frameworks "
                        "xnn,torch_sim --cueq --mace-fusion split --variants "
                        "split+tf32x3,split+tf32x3+int32 --json "
                        "benchmarks/results/peers_h200.json (gpu_suite.sh 23a)"),
    "peers_nvalchemi_h200.json": ("python benchmarks/peers.py --device cuda --dtype float32 "
                                  "--sizes 10000 --batched none --models mace --steps 9 "
                                  "--budget-s 100 --frameworks xnn_step_graph,torch_sim,nvalchemi "
                                  "--cueq --json benchmarks/results/peers_nvalchemi_h200.json "
                                  "(gpu_suite.sh 13)"),
    "calculator_cpu.json": ("python benchmarks/calculator.py --json "
                            "benchmarks/results/calculator_cpu.json"),
    "kernel_backends_h200.json": ("python benchmarks/kernel_backends.py --device cuda --backends "
                                  "reference,triton --json "
                                  "benchmarks/results/kernel_backends_h200.json"),
    "triton_tp_h200.json": ("the old and new forward kernels timed in one process (commit "
                            "80007cf; benchmarks/triton_tp.py times the current kernels)"),
    "triton_mlp_h200.json": ("python benchmarks/triton_mlp.py --device cuda --json "
                             "benchmarks/results/triton_mlp_h200.json"),
    "triton_mlp_sweep_h200.json": ("python benchmarks/triton_mlp.py --device cuda --blocks 1 "
                                   "--scale off --sweep --sweep-precisions tf32x3 "
                                   "--sweep-budget-s 90 --repeat 10 --json "
                                   "benchmarks/results/triton_mlp_sweep_h200.json"),
    "training_h200.json": ("python benchmarks/training.py --device cuda --json "
                           "benchmarks/results/training_h200.json"),
    "training_compile_h200.json": ("python benchmarks/training.py --device cuda --no-mace --steps "
                                   "60 [--compile] --json "
                                   "benchmarks/results/training_compile_h200.json (two runs: "
                                   "eager, compiled)"),
    "training_vs_mace_h200.json": ("python benchmarks/training.py --device cuda --models "
                                   "equivariant --epochs 8 --json "
                                   "benchmarks/results/training_vs_mace_h200.json"),
    "training_ddp_h200x2.json": ("torchrun --nproc-per-node 2 benchmarks/training.py --device "
                                 "cuda --no-mace --steps 60 [--compile] --json "
                                 "benchmarks/results/training_ddp_h200x2.json (one run per row)"),
    "accuracy_vs_mace_h200.json": ("python benchmarks/accuracy_vs_mace.py --device cuda --epochs "
                                   "20 --json benchmarks/results/accuracy_vs_mace_h200.json"),
    "accuracy_vs_mace_cpu.json": ("python benchmarks/accuracy_vs_mace.py --seed 1 --json "
                                  "benchmarks/results/accuracy_vs_mace_cpu.json"),
    "activation_memory_cpu.json": ("python benchmarks/activation_memory.py --json "
                                   "benchmarks/results/activation_memory_cpu.json"),
    "dd_equivariant_h200x2.json": ("torchrun --nproc-per-node 2 benchmarks/dd.py --device cuda "
                                   "--models equivariant --sizes 1000000 --atoms-per-rank 250000 "
                                   "--scaling both --repeat 3 --timeout 190 --json "
                                   "benchmarks/results/dd_equivariant_h200x2.json"),
    "dd_equivariant_h200x4.json": ("torchrun --nproc-per-node 4 benchmarks/dd.py --device cuda "
                                   "--models equivariant --sizes 1000000 --atoms-per-rank 250000 "
                                   "--scaling both --repeat 3 --timeout 380 --json "
                                   "benchmarks/results/dd_equivariant_h200x4.json"),
    "dd_painn_h200x4.json": ("torchrun --nproc-per-node 4 benchmarks/dd.py --device cuda --models "
                             "painn --sizes 100000 --atoms-per-rank 100000 --scaling both "
                             "--repeat 3 --timeout 190 --json "
                             "benchmarks/results/dd_painn_h200x4.json"),
    "dd_sevenn_h200x2.json": ("torchrun --nproc-per-node 2 benchmarks/dd.py --device cuda "
                              "--models sevenn --sizes 20000,40000 --scaling strong --repeat 2 "
                              "--timeout 120 --json benchmarks/results/dd_sevenn_h200x2.json"),
    "dd_find_max_h200x2.json": ("torchrun --nproc-per-node 2 benchmarks/dd.py --device cuda "
                                "--models equivariant --scaling none --find-max 250000 --timeout "
                                "120 --json benchmarks/results/dd_find_max_h200x2.json"),
    "dd_halo_graph_gloo2.json": ("torchrun --nproc-per-node 2 benchmarks/dd.py --quick --models "
                                 "painn --modes halo,graph --sizes 108,500,2048,4000,8000 "
                                 "--scaling none --dtype float64 --device cpu --repeat 3 --json "
                                 "benchmarks/results/dd_halo_graph_gloo2.json"),
    "dd_halo_graph_gloo4.json": ("torchrun --nproc-per-node 4 benchmarks/dd.py --quick --models "
                                 "painn --modes halo,graph --sizes 108,500,2048 --scaling none "
                                 "--dtype float64 --device cpu --repeat 3 --json "
                                 "benchmarks/results/dd_halo_graph_gloo4.json"),
    "dd_md_cpu16.json": ("python benchmarks/dd_md.py --sizes 1000000 --ranks 1,2,4,8 --layouts "
                         "domain --steps 3 --warmup 1 --timeout 400 --json "
                         "benchmarks/results/dd_md_cpu16.json"),
    "dd_md_replicated_cpu16.json": ("python benchmarks/dd_md.py --sizes 1000000 --ranks 8 "
                                    "--layouts replicated --replicated-max-atoms 2000000 --steps "
                                    "1 --warmup 0 --timeout 140 --json "
                                    "benchmarks/results/dd_md_replicated_cpu16.json"),
    "dd_md_cpu.json": ("python benchmarks/dd_md.py --sizes 256000 --ranks 1,2,4,8 --layouts "
                       "domain --steps 4 --warmup 1 --json benchmarks/results/dd_md_cpu.json"),
    "dd_md_compiled_cpu.json": ("python benchmarks/dd_md.py --compile --ranks 2 --sizes 2000 "
                                "--layouts domain --steps 30 --json "
                                "benchmarks/results/dd_md_compiled_cpu.json"),
    "dd_md_h200.json": ("python benchmarks/dd_md.py --device cuda --dtype float32 --sizes "
                        "32000,256000,1000000 --ranks 1 --layouts domain --steps 20 --warmup 5 "
                        "--json benchmarks/results/dd_md_h200.json"),
    "dd_md_equivariant_h200.json": ("python benchmarks/dd_md.py --device cuda --dtype float32 "
                                    "--model equivariant --sizes 32000,108000 --ranks 1 --layouts "
                                    "domain --steps 10 --json "
                                    "benchmarks/results/dd_md_equivariant_h200.json"),
    "cp_training_cpu16.json": ("python benchmarks/cp_training.py --model schnet --hparams "
                               "'{\"num_features\": 32, \"num_filters\": 32}' --atoms 20000,60000 "
                               "--dd 1,2,4 --cutoff 4 --steps 1 --threads 4 --json "
                               "benchmarks/results/cp_training_cpu16.json"),
    "cp_training_equivariant_cpu16.json": ("python benchmarks/cp_training.py --model equivariant "
                                           "--hparams '{\"channels\": 32}' --atoms 2000,4000 --dd "
                                           "1,4 --checkpointing --cutoff 4 --steps 1 --threads 4 "
                                           "--json "
                                           "benchmarks/results/cp_training_equivariant_cpu16.json"),
    "long_range_h200.json": ("python benchmarks/long_range.py --device cuda --json "
                             "benchmarks/results/long_range_h200.json"),
    "long_range_cpu.json": ("python benchmarks/long_range.py --quick --json "
                            "benchmarks/results/long_range_cpu.json"),
    "long_range_dd_cpu16.json": ("python benchmarks/long_range.py --sizes 10000 100000 --dd 1,2,4 "
                                 "--no-direct --json benchmarks/results/long_range_dd_cpu16.json"),
    "validate_lj_h200x2.json": ("torchrun --nproc-per-node 2 -m xnn validate --model "
                                "lj:sigma=2.3,epsilon=0.4,cutoff=5.0 --structure cu_tri.xyz "
                                "--dtype float64 --device cuda --json "
                                "benchmarks/results/validate_lj_h200x2.json"),
    "validate_painn_h200x2.json": ("torchrun --nproc-per-node 2 -m xnn validate --model painn "
                                   "--structure cu_tri.xyz --dtype float64 --device cuda --json "
                                   "benchmarks/results/validate_painn_h200x2.json"),
    "validate_equivariant_h200x2.json": ("torchrun --nproc-per-node 2 -m xnn validate --model "
                                         "equivariant --mode sync --structure cu_tri.xyz --dtype "
                                         "float64 "
                                         "--device cuda --json "
                                         "benchmarks/results/validate_equivariant_h200x2.json"),
    "validate_sevenn_h200x2.json": ("torchrun --nproc-per-node 2 -m xnn validate --model "
                                    "sevenn:checkpoint=7net-0 --structure cu256_tri.xyz --dtype "
                                    "float64 --device cuda --json "
                                    "benchmarks/results/validate_sevenn_h200x2.json"),
    "validate_equivariant_h200x4.json": ("torchrun --nproc-per-node 4 -m xnn validate --model "
                                         "equivariant --mode sync --structure cu_tri.xyz --dtype "
                                         "float64 "
                                         "--device cuda --json "
                                         "benchmarks/results/validate_equivariant_h200x4.json"),
    "data_scale_h100.json": ("python benchmarks/data_scale.py --device cuda --n 10000 --batches 60 "
                             "--workers 0,2,4,8 --note '<the machine note in the file>' --json "
                             "benchmarks/results/data_scale_h100.json"),
    "data_scale_cpu.json": ("python benchmarks/data_scale.py --n 5000 --batches 40 --note "
                            "'<the machine note in the file>' --json "
                            "benchmarks/results/data_scale_cpu.json"),
    "index_scale_cpu.json": ("python benchmarks/index_scale.py --formats extxyz aselmdb "
                             "--json benchmarks/results/index_scale_cpu.json"),
    "ghost_plan_scale_cpu.json": ("python benchmarks/ghost_plan_scale.py --json "
                                  "benchmarks/results/ghost_plan_scale_cpu.json"),
    "balance_scale_cpu.json": ("python benchmarks/balance_scale.py --json "
                               "benchmarks/results/balance_scale_cpu.json"),
    "plan_scale_cpu.json": ("python benchmarks/plan_scale.py --json "
                            "benchmarks/results/plan_scale_cpu.json"),
    "io_scale_cpu.json": ("python benchmarks/io_scale.py --sizes 100000 1000000 --ranks 1 2 4 "
                          "--dir /tmp/io_s/bench --json benchmarks/results/io_scale_cpu.json"),
    "lammps_cpu.json": ("python benchmarks/lammps.py --sizes 2000,16000 --schnet-sizes 2000 "
                        "--modes halo,sync --ranks 1,2,4 --repeat 2 --steps 10 --warmup 2 "
                        "--note '<the machine note in the file>' --json "
                        "benchmarks/results/lammps_cpu.json"),
    "lammps_breakdown_h100.json": ("python benchmarks/lammps_breakdown.py --device cuda "
                                   "--dtype float32 --json "
                                   "benchmarks/results/lammps_breakdown_h100.json"),
    "data_scale_h200.json": ("python benchmarks/data_scale.py --device cuda --n 10000 --batches 60 "
                             "--workers 0,2,4,8 --note '<the machine note in the file>' --json "
                             "benchmarks/results/data_scale_h200.json"),
    "lammps_h100.json": ("python benchmarks/lammps.py --device cuda --dtype float32 "
                         "--models lj,schnet --sizes 2000,16000 --schnet-sizes 2000,16000 "
                         "--ranks 1 --steps 20 --warmup 3 --repeat 3 --json "
                         "benchmarks/results/lammps_h100.json"),
    "lammps_cpu16.json": ("OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=33554432 "
                          "MALLOC_TRIM_THRESHOLD_=1073741824 python benchmarks/lammps.py "
                          "--models lj --sizes 50000 "
                          "--ranks 1,2,4 --steps 20 --warmup 3 --repeat 1 "
                          "--mpirun <mpich's mpirun> "
                          "--note '<the machine note in the file>' --json "
                          "benchmarks/results/lammps_cpu16.json (the 16-core GPU host)"),
    "dd_components_cpu16.json": (
        "OMP_NUM_THREADS=1 python benchmarks/dd_components.py --models schnet --ranks 1,2,4,8 "
        "--sizes 2048 --scales 1.0,1.1 --steps 4 --warmup 1 --threads 1 --timeout 60 --json J; "
        "... --models schnet --ranks 1 --sizes 256,864 --append; then into J2: ... --models "
        "equivariant --ranks 1,2,4,8 --sizes 500 --timeout 120; ... --models equivariant "
        "--ranks 1 --sizes 108,256 --append; J's and J2's rows joined (J = "
        "benchmarks/results/dd_components_cpu16.json; the 16-core GPU host)"),
    "dd_components_cpu16x2.json": (
        "OMP_NUM_THREADS=1 taskset -c 0,1 python benchmarks/dd_components.py --models lj "
        "--ranks 1,2 --sizes 2000,4000,8000,16000 --scales 1.0,1.1 --steps 60 --warmup 5 "
        "--threads 1 --timeout 40 --json J; ... --models schnet --ranks 1,2 --sizes 1000 "
        "--steps 5 --warmup 1 --append; ... --models schnet --ranks 1 --sizes 256,500 --append; "
        "the equivariant rows of the earlier run: --models equivariant --ranks 1,2 --sizes 500 "
        "--steps 4 --warmup 1 (J = "
        "benchmarks/results/dd_components_cpu16x2.json; the 16-core GPU host, 2 cores)"),
    "dd_components_h100.json": (
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/dd_components.py "
        "--device cuda --models mace --ranks 1 --sizes 1000,2000 --scales 1.0,1.1 --steps 8 "
        "--warmup 2 --json J; ... --sizes 8000,16000 --append; and without the allocator "
        "variable ... --sizes 4000,32000, 108000, 256000 (x1.0 only) into J2; rows joined "
        "(J = benchmarks/results/dd_components_h100.json)"),
    "scaling_model_cpu.json": ("python benchmarks/scaling_model.py --plots docs/img --json "
                               "benchmarks/results/scaling_model_cpu.json"),
}

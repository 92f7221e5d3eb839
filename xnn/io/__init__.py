"""The I/O layer: the ASE calculator and every file a run writes (trajectories, MD/relax
checkpoints, the thermo log and plot, the training log, run folders)."""

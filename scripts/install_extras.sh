#!/usr/bin/env bash
# Optional model wrappers that the test suite exercises: SevenNet (pretrained, e3nn >= 0.5) and
# mace-torch. mace-torch pins e3nn==0.4.4, which conflicts with sevenn; freshly built MACE models
# run under e3nn 0.6, so mace-torch is installed without its pin (--no-deps) plus its other needs.
set -euo pipefail
PY=${1:-python}
if [ "${XNN_SKIP_EXTRAS:-0}" = "1" ]; then echo "XNN_SKIP_EXTRAS=1: not installing mace-torch/sevenn"; exit 0; fi
"$PY" -m pip install -q "sevenn==0.13.0" || echo "warning: sevenn could not be installed; its tests will be skipped"
"$PY" -m pip install -q --no-deps "mace-torch==0.3.16" || echo "warning: mace-torch could not be installed"
"$PY" -m pip install -q matscipy torch-ema opt_einsum prettytable lmdb orjson python-hostlist configargparse GitPython torchmetrics || true

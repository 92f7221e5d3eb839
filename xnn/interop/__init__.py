"""Bridges to other atomistic toolkits; each imports its toolkit only when used.

* :mod:`xnn.interop.torchsim`: an xnn model as a torch-sim ``ModelInterface``
  (:class:`~xnn.interop.torchsim.XnnTorchSimModel`) and a torch-sim model as an xnn
  potential (:class:`~xnn.interop.torchsim.TorchSimPotential`).
* :mod:`xnn.interop.lammps`: an xnn model as the force field of a LAMMPS run, on one or
  many MPI ranks, through ``fix external`` (:class:`~xnn.interop.lammps.XnnFixExternal`,
  the ``xnn lammps`` command).
* :mod:`xnn.interop.mliap`: an xnn model as LAMMPS's ``pair_style mliap unified`` (Kokkos
  builds with ML-IAP + Python; written by ``xnn export --format lammps-mliap``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from xnn.errors import InputError

if TYPE_CHECKING:
    from xnn.models.base import AtomisticModel


def load_xnn_model(model_or_path, trust: bool = False) -> AtomisticModel:
    """An xnn model given as itself or as a model file path (``model.pt`` / ``.xnn``).

    Args:
        model_or_path: the model, or its file (read as data by :func:`xnn.load_model`).
        trust: the caller trusts the file: it may unpickle what it holds or names, which can
            run code (:mod:`xnn.models.trust`); a file never grants trust by itself.
    Raises:
        InputError: for anything else (a module that is no
            :class:`~xnn.models.base.AtomisticModel` is not an xnn model).
        ModelFileError: the file is refused (among others: it asks for trust not given).
    """
    from xnn.models.base import as_model

    if isinstance(model_or_path, (str, os.PathLike)):
        from xnn.models.serialization import load_model

        return as_model(load_model(Path(model_or_path), trust=trust), f"{model_or_path}")
    if not isinstance(model_or_path, torch.nn.Module):
        raise InputError(f"expected an xnn model or a model file path, got "
                         f"{type(model_or_path).__name__}")
    return as_model(model_or_path, "the model given")

"""xnn.testing's execution-mode contracts on every native model: decomposed (halo, sync,
graph) equals one process on gloo ranks, the compiled MD step equals eager, the ASE,
torch-sim and LAMMPS adapters give the numbers of ``Potential``; and each contract fails on a
model that breaks its promise. (The MACE and SevenNet wrappers run the same contracts in
tests/test_external_mace.py and tests/test_external_sevenn.py.)
"""

from __future__ import annotations

import functools
import unittest

import pytest
import torch
from helpers import counting_lj, lj, native

from xnn.models import build
from xnn.models.base import AtomisticModel
from xnn.testing import (
    DecompositionCase,
    assert_decomposition_errors,
    check_adapters,
    check_compiled_step,
    check_decomposition,
    check_lammps_adapter,
    check_torchsim_adapter,
    decomposition_modes,
    run_decomposition_cases,
)
from xnn.testing.decomposition import default_decomposition_systems

TOL = 1e-10


def morse():
    return build("morse", D=0.35, alpha=1.4, r0=2.5, cutoff=5.0).double()


def d3():
    pytest.importorskip("tad_dftd3")
    return build("d3", functional="pbe", cutoff=5.0, cn_cutoff=4.0, s9=1.0, atm_cutoff=6.0)


MODELS = {"lj": lambda: lj(dtype=torch.float64), "morse": morse,
          "schnet": lambda: native("schnet"), "painn": lambda: native("painn"),
          "equivariant": lambda: native("equivariant")}


# ---------------------------------------------------------------- decomposed == one process
def _cases(names):
    systems = default_decomposition_systems([29])
    cases = [DecompositionCase(f"{name}-{s}-{mode}", MODELS[name](), g, mode)
             for name in names for s, g in systems.items()
             for mode in decomposition_modes(MODELS[name]())]
    # a model that is not local: its energies depend on how many atoms a rank holds
    cases.append(DecompositionCase("counting-periodic-halo", counting_lj(),
                                   systems["periodic"], "halo"))
    return cases


@functools.cache
def _decomposed(world_size):
    """Every model's cases in ONE set of ``world_size`` gloo ranks."""
    return run_decomposition_cases(_cases(MODELS), world_size)


def test_decomposition_modes_follow_the_declared_capabilities():
    assert decomposition_modes(MODELS["lj"]()) == ("halo", "graph")
    for name in ("schnet", "painn", "equivariant"):
        assert decomposition_modes(MODELS[name]()) == ("halo", "sync", "graph")
    # three layers with two sync points split in graph mode; a long-range term does not
    assert "graph" in decomposition_modes(native("schnet", layers=3))


def test_a_long_range_term_is_decomposed_in_halo_mode_only():
    assert decomposition_modes(d3()) == ("halo",)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(MODELS))
def test_decomposed_equals_one_process(world_size, name):
    errors = {k: e for k, e in _decomposed(world_size).items() if k.startswith(name + "-")}
    modes = {e["mode"] for e in errors.values()}
    assert modes == set(decomposition_modes(MODELS[name]())), modes
    assert len(errors) == 2 * len(modes)  # a periodic system and a molecule
    assert_decomposition_errors(errors, TOL)


@pytest.mark.distributed
def test_decomposition_contract_fails_on_a_model_that_is_not_local():
    errors = {"counting-periodic-halo": _decomposed(2)["counting-periodic-halo"]}
    assert errors["counting-periodic-halo"]["energy"] > 1e-4
    with pytest.raises(AssertionError, match=r"counting-periodic-halo \(halo\): energy"):
        assert_decomposition_errors(errors, TOL)


@pytest.mark.distributed
@pytest.mark.slow
def test_check_decomposition_spawns_its_own_ranks():
    """The one-call form a model author uses (its own spawn: slow here)."""
    errors = check_decomposition(native("painn"), world_size=2)
    assert sorted(errors) == sorted(f"{s}-{m}" for s in ("periodic", "molecule")
                                    for m in ("halo", "sync", "graph"))


# ---------------------------------------------------------------- compiled step == eager
@pytest.mark.parametrize("name", ["lj", "morse", "schnet",
                                  pytest.param("painn", marks=pytest.mark.slow),
                                  pytest.param("equivariant", marks=pytest.mark.slow)])
def test_compiled_step_equals_eager(name, one_thread):
    out = check_compiled_step(MODELS[name](), steps=8)
    assert out["n_compiles"] == 1


class PythonBranch(AtomisticModel):
    """A pair model that branches in Python on a tensor value: it cannot be traced."""

    def __init__(self):
        super().__init__()
        self.cutoff = 4.0

    def forward(self, graph):
        r2 = graph.edge_vectors().pow(2).sum(-1)
        e = torch.zeros(graph.n_atoms, dtype=r2.dtype).index_add(
            0, graph.edge_index[1], torch.exp(-r2))
        return e * 2.0 if float(e.sum()) > 0 else e


def test_compiled_contract_fails_on_an_untraceable_model(one_thread):
    with pytest.raises(Exception, match="data-dependent|Data-dependent|GuardOnDataDependent"):
        check_compiled_step(PythonBranch(), steps=1)


def test_compiled_contract_skips_a_model_declared_untraceable():
    model = lj(dtype=torch.float64)
    model.traceable = False
    with pytest.raises(unittest.SkipTest, match="traceable"):
        check_compiled_step(model)


# ---------------------------------------------------------------- adapters == Potential
@pytest.mark.parametrize("name", list(MODELS))
def test_adapters_equal_potential(name):
    out = check_adapters(MODELS[name]())
    assert out["ase"] <= TOL
    for front_end in ("torchsim", "lammps"):  # installed here; a skip names its reason
        assert isinstance(out[front_end], float) or out[front_end].startswith("skipped: ")


def test_adapters_of_a_long_range_term():
    out = check_adapters(d3())
    assert out["ase"] <= TOL


def test_adapter_contracts_skip_with_the_reason(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch_sim", None)  # import torch_sim -> ImportError
    with pytest.raises(unittest.SkipTest, match="torch-sim is not installed"):
        check_torchsim_adapter(lj())
    from xnn.interop import lammps as lammps_module

    def missing():
        from xnn.errors import InputError

        raise InputError("LAMMPS is not installed: pip install 'lammps[mpi]'")

    monkeypatch.setattr(lammps_module, "require_lammps", missing)
    with pytest.raises(unittest.SkipTest, match="LAMMPS unavailable: LAMMPS is not installed"):
        check_lammps_adapter(lj())

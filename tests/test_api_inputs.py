"""Bad arguments of xnn's Python API and model hyperparameters: one line of xnn error, the same
line whatever the door (``xnn.models.build``, ``xnn validate --model``, ``xnn md``'s
``model.params``, ``xnn train``), before anything runs or is written; legitimate values
(symbols, numpy integers and floats, ``min_distance=0``) still accepted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.build import bulk
from ase.io import write
from error_helpers import cli_fails, raises_one_line

import xnn
from xnn.data import read
from xnn.errors import InputError
from xnn.models import build
from xnn.models.painn import PaiNN
from xnn.models.schnet import SchNet

SMALL = {  # the smallest valid hyperparameters of every model with a cutoff
    "lj": dict(sigma=2.3, epsilon=0.01),
    "morse": dict(D=0.3, alpha=1.4, r0=2.5),
    "schnet": dict(species=[29], num_features=4, num_filters=4, num_interactions=1,
                   num_basis=2),
    "painn": dict(species=[29], num_features=4, num_interactions=1, num_basis=2),
    "equivariant": dict(species=[29], channels=2, num_interactions=1, l_max=1,
                        hidden_l_max=0, correlation=1, radial_mlp=[2], readout_hidden=0),
    "d3": dict(),
    "ewald": dict(),
    "pme": dict(),
    "coulomb": dict(),
}
WITH_SPECIES = ["lj", "morse", "schnet", "painn", "equivariant"]


@pytest.mark.parametrize("name", list(SMALL))
def test_every_model_refuses_a_cutoff_that_is_no_distance_with_the_same_line(name):
    """Was: ZeroDivisionError or 'math domain error' (schnet, painn, equivariant), a negative
    cutoff accepted (schnet), a line of its own wording per model (lj, d3, ewald)."""
    kw = dict(SMALL[name], cutoff=5.0)
    assert build(name, **kw).cutoff >= 5.0
    for bad in (0.0, -1.0, -1):
        msg = raises_one_line(InputError, build, name, **{**kw, "cutoff": bad})
        assert msg == f"model {name!r}: hyperparameter cutoff={bad!r} must be a finite " \
            "distance > 0 (Å)", msg


@pytest.mark.parametrize("name", WITH_SPECIES)
def test_every_model_refuses_species_that_are_no_elements(name):
    """Was: species=[] and [0] accepted (a model that knows nothing, or the dummy element),
    [200] an IndexError, [29, 29] accepted (two embeddings of copper, one of them unused)."""
    kw = dict(SMALL[name], cutoff=5.0)
    pre = f"model {name!r}: hyperparameter species="
    cases = {(): "must be a non-empty list of elements",
             (0,): "unknown element 0: atomic numbers are 1-118",
             (200,): "unknown element 200: atomic numbers are 1-118",
             (29, 29): "names ['Cu'] more than once: give each element once"}
    for species, words in cases.items():
        msg = raises_one_line(InputError, build, name, **{**kw, "species": list(species)})
        assert msg.startswith(f"{pre}{list(species)!r}") and words in msg, msg
    # what a user may give: numpy integers (from ase), several elements in any order
    model = build(name, **{**kw, "species": [np.int64(79), 29]})
    assert list(model.species) in ([79, 29], [29, 79])


def test_pair_potentials_take_element_symbols():
    assert build("lj", sigma=2.3, epsilon=0.01, cutoff=5.0, species=["Cu", "Au"]).species \
        == [29, 79]
    msg = raises_one_line(InputError, build, "morse", D=0.3, alpha=1.4, r0=2.5, cutoff=5.0,
                          species=["Cu", "Xx"])
    assert "species=['Cu', 'Xx']: unknown element symbol 'Xx'" in msg


def test_native_models_built_directly_are_checked_too():
    """The classes check what ``build`` checks (was: IndexError / ZeroDivisionError)."""
    msg = raises_one_line(InputError, SchNet, species=[200])
    assert msg.startswith("SchNet: species=[200]: unknown element 200"), msg
    msg = raises_one_line(InputError, PaiNN, species=[29], cutoff=0.0)
    assert msg == "PaiNN: cutoff=0.0 must be a finite distance > 0 (Å)", msg


def test_sizes_that_build_no_network_are_refused():
    """PaiNN's readout is num_features // 2 wide: 1 built a zero-width layer (accepted with a
    torch warning); a negative D3 max_triples refused every evaluation later."""
    raises_one_line(InputError, build, "painn", species=[29], num_features=1,
                    match="num_features=1 must be an integer >= 2")
    assert build("painn", species=[29], num_features=2, num_interactions=1).cutoff == 5.0
    raises_one_line(InputError, build, "d3", max_triples=-1, match="max_triples=-1")


@pytest.fixture(scope="module")
def argon_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ar") / "ar.xyz"
    write(path, bulk("Ar", "fcc", a=5.26, cubic=True).repeat(2))
    return path


def test_the_same_line_from_every_door(tmp_path, argon_file, capsys):
    """``build`` and ``xnn validate --model`` give one line, the same (was: 'math domain
    error' from validate and md); ``xnn md`` and ``xnn train`` refuse the typed
    ``model.cutoff`` of their one model section with the same line; ``xnn train``'s
    ``model.species`` is checked as a model's species (was: an IndexError in the statistics
    of the data)."""
    want = str(raises_one_line(InputError, build, "painn", species=[18], cutoff=-1))
    line = cli_fails(capsys, ["validate", "--model", "painn:cutoff=-1", "--structure",
                              argon_file])
    assert line == f"xnn validate: error: {want}", line
    out = tmp_path / "md"
    line = cli_fails(capsys, ["md", f"structure={argon_file}", f"output.dir={out}",
                              "model.name=painn", "model.species=[18]",
                              "model.cutoff=-1", "steps=1"])
    assert line == "xnn md: error: model.cutoff=-1.0 must be > 0.0", line
    assert not out.exists()
    line = cli_fails(capsys, ["train", f"data.datasets.0.path={argon_file}",
                              f"output_dir={out}", "model.cutoff=-1", "device=cpu"])
    assert line == "xnn train: error: model.cutoff=-1.0 must be > 0.0", line
    assert not out.exists()
    out = tmp_path / "train"
    line = cli_fails(capsys, ["train", f"data.datasets.0.path={argon_file}",
                              f"output_dir={out}", "model.species=[18, 200]", "device=cpu"])
    assert line == "xnn train: error: model.species=[18, 200]: unknown element 200: " \
        "atomic numbers are 1-118", line
    assert not out.exists()


def test_a_path_argument_that_is_no_path(tmp_path):
    """Was: TypeError from pathlib."""
    for bad in (None, 123):
        msg = raises_one_line(InputError, xnn.load_model, bad)
        assert msg.startswith("xnn.load_model: expected the path of a model file") \
            and type(bad).__name__ in msg, msg
    msg = raises_one_line(InputError, read, None)
    assert msg.startswith("xnn.data.read: expected the path of a data file") \
        and "NoneType" in msg, msg


def _cu():
    atoms = bulk("Cu", "fcc", a=3.6).repeat(2)
    atoms.positions[1] = atoms.positions[0] + [0.02, 0.0, 0.0]  # coincident with atom 0
    return atoms


def test_calculator_dtype_and_min_distance():
    """Was: torch's TypeError for an integer dtype (half precision: linalg.inv's error at
    the first call), ``min_distance=-1`` or nan accepted (no check at all)."""
    lj = build("lj", sigma=2.3, epsilon=0.4, cutoff=5.0)
    for dtype in (torch.int64, torch.float16, "float32"):
        msg = raises_one_line(InputError, xnn.Calculator, lj, device="cpu", dtype=dtype)
        assert msg.startswith(f"xnn.Calculator: dtype={dtype!r} is not supported") \
            and "torch.float64 or torch.float32" in msg, msg
    for bad in (-1.0, float("nan"), float("inf"), True):
        raises_one_line(InputError, xnn.Calculator, lj, device="cpu", min_distance=bad,
                        match=r"min_distance=.* must be a finite distance >= 0")
    atoms = _cu()
    atoms.calc = xnn.Calculator(lj, device="cpu", dtype=torch.float32, min_distance=0)
    assert np.isfinite(atoms.get_potential_energy())  # 0: evaluated anyway
    atoms.calc = xnn.Calculator(lj, device="cpu")
    msg = raises_one_line(InputError, atoms.get_potential_energy)
    assert msg.startswith("atoms 0 and 1 are 0.02 Å apart, closer than min_distance=0.1"), msg


def test_an_unknown_device_names_the_valid_ones():
    """Was: torch's list of every device type it knows (tpu was not among them)."""
    msg = raises_one_line(InputError, xnn.Calculator, build("lj", sigma=2.3, epsilon=0.4,
                                                            cutoff=5.0), device="tpu")
    assert msg == "invalid device 'tpu': use cpu, cuda, cuda:N or auto", msg

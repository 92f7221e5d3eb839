"""Tracebacks and misleading messages become one line that says what was wrong and what to
do (issue 42, item 5): training a model with nothing to train, exporting under a file, a
path given to ``xnn.Calculator``, non-finite charges, a folder given as a file, and the
LAMMPS bridge's species and coincident-atom checks."""

from __future__ import annotations

import numpy as np
import pytest
from error_helpers import cli_fails, raises_one_line

from xnn.errors import InputError

LJ_HP = "model.hyperparameters={sigma: 2.3, epsilon: 0.4}"
TINY = ["model.cutoff=3.0", "data.batch_size=3", "data.val_fraction=0.25", "max_epochs=1",
        "logging.plots=false", "logging.progress_bar=false", "device=cpu"]


@pytest.fixture(scope="module")
def cu_data(tmp_path_factory):
    from xnn.data.emt import write_emt

    path = tmp_path_factory.mktemp("emt") / "cu.xyz"
    write_emt(path, 8, ["Cu"], seed=0)
    return path


# ------------------------------------------------------------ nothing to train
def test_training_a_model_without_trainable_parameters_is_refused(tmp_path, cu_data, capsys):
    from xnn.app.train import train
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig
    from xnn.models import build
    from xnn.models.serialization import save_model

    out = tmp_path / "run"
    base = ["train", f"data.datasets.0.path={cu_data}", f"output_dir={out}", *TINY]
    cli_fails(capsys, base + ["model.name=lj", LJ_HP], "model.name=lj has no trainable "
              "parameters", "model.name=schnet", "pretrained=", "xnn eval")
    frozen = ("model.hyperparameters={terms: [{name: lj, sigma: 2.3, epsilon: 0.4, "
              "trainable: false}, {name: morse, D: 0.3, alpha: 1.4, r0: 2.5, trainable: false}]}")
    cli_fails(capsys, base + ["model.name=sum", frozen], "model.name=sum has no trainable")
    lj = save_model(build("lj", sigma=2.3, epsilon=0.4, cutoff=3.0), tmp_path / "lj.pt")
    cli_fails(capsys, base + [f"pretrained={lj}"], f"pretrained={str(lj)!r} has no trainable")
    cli_fails(capsys, base + [f"pretrained={lj}", "validation_only=true"], "xnn eval")
    assert not out.exists()
    # a frozen LJ under a trainable SchNet trains (delta learning)
    delta = ("model.hyperparameters={terms: [{name: lj, sigma: 2.3, epsilon: 0.4, "
             "trainable: false}, {name: schnet, num_features: 8, num_filters: 8, "
             "num_interactions: 1, num_basis: 8}]}")
    summary = train(load_config(TrainConfig, None, base[1:] + ["model.name=sum", delta]))
    assert (out / "model.pt").is_file() and np.isfinite(summary["epochs"])


# ------------------------------------------------------------ xnn.Calculator("model.pt")
class _OpensMarker:
    """Unpickling this calls ``open(marker, "w")``: the marker file appears."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def pickled_mace_file(folder, model):
    """A model file of the pickled MACE format of earlier xnn versions whose module, when
    unpickled, creates a marker file; returns ``(path, marker)``."""
    import io

    import torch

    from xnn.models.serialization import model_payload

    def torch_bytes(obj) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    marker = folder / "code-ran"
    header = {k: v for k, v in model_payload(model).items() if k not in ("hparams",
                                                                         "state_dict")}
    path = folder / "pickled.pt"
    path.write_bytes(torch_bytes({**header, "name": "mace", "kind": "mace-torch-pickle",
                                  "head": None,
                                  "module_bytes": torch_bytes(_OpensMarker(marker))}))
    return path, marker


def test_calculator_takes_a_model_file_path(tmp_path):
    import torch
    from ase.build import bulk

    import xnn
    from xnn.errors import ModelFileError, XnnError
    from xnn.models import build

    torch.manual_seed(0)
    model = build("schnet", species=[29], cutoff=4.0, num_features=8, num_filters=8,
                  num_interactions=1, num_basis=8)
    path = xnn.save_model(model, tmp_path / "model.pt")
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.rattle(0.05, seed=0)
    ref = atoms.copy()
    ref.calc = xnn.Calculator(model, device="cpu")
    for given in (str(path), path):
        atoms.calc = xnn.Calculator(given, device="cpu")
        assert atoms.get_potential_energy() == ref.get_potential_energy()
        np.testing.assert_array_equal(atoms.get_forces(), ref.get_forces())
        np.testing.assert_array_equal(atoms.get_stress(), ref.get_stress())
    assert atoms.calc.model.training is False
    raises_one_line(ModelFileError, xnn.Calculator, tmp_path / "none.pt", match="does not exist")
    raises_one_line(ModelFileError, xnn.Calculator, tmp_path, match="did you mean")
    msg = raises_one_line(InputError, xnn.Calculator, 42)
    assert "an xnn model or a model file path, got int" in msg
    # trust= reaches the loader: a file holding pickled code is unpickled only with it
    f, marker = pickled_mace_file(tmp_path, model)
    raises_one_line(XnnError, xnn.Calculator, f, device="cpu", match="trust=True")
    assert not marker.exists()
    pytest.importorskip("mace")
    with pytest.raises(XnnError):
        xnn.Calculator(f, device="cpu", trust=True)  # not a MACE model, but it was unpickled
    assert marker.exists()


# ------------------------------------------------------------ non-finite charges
@pytest.mark.parametrize("name", ["pme", "ewald", "coulomb"])
def test_non_finite_charges_are_named(name, tmp_path, capsys):
    from ase.build import bulk
    from ase.io import write

    import xnn
    from xnn.models import build

    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True)
    if name == "coulomb":
        atoms.pbc, atoms.cell = False, np.zeros((3, 3))
    q = np.where(atoms.numbers == 11, 1.0, -1.0)
    atoms.set_initial_charges(q)
    atoms.calc = xnn.Calculator(build(name, cutoff=5.0, charges="data"), device="cpu")
    e = atoms.get_potential_energy()
    assert np.isfinite(e) and e < 0
    for value in (np.nan, np.inf):
        bad = q.copy()
        bad[[3, 6]] = value
        atoms.set_initial_charges(bad)
        msg = raises_one_line(InputError, atoms.get_potential_energy)
        assert f"non-finite charges on system 0, atoms [3, 6] (values [{value}, {value}])" \
            in msg and "initial_charges" in msg, msg
    # in a batch: the system and the atom's index within it
    from xnn.data.ase_io import from_ase
    from xnn.models import Potential

    good = atoms.copy()
    good.set_initial_charges(q)
    graph = from_ase([good, atoms], energy_key=None, forces_key=None, stress_key=None)
    raises_one_line(InputError, Potential(build(name, cutoff=5.0, charges="data")), graph,
                    match=r"system 1, atoms \[3, 6\]")
    # a table by element, and the CLI (torch-pme's own message blamed the mesh spacing)
    raises_one_line(InputError, type(build(name, charges="data")), charges={"Na": np.nan,
                                                                           "Cl": -1.0},
                    match="charges table has non-finite values {'Na': nan}")
    if name == "pme":
        write(tmp_path / "nacl.xyz", atoms)
        cli_fails(capsys, ["md", f"structure={tmp_path / 'nacl.xyz'}", "model.name=pme",
                           "model.hyperparameters={charges: data}", "model.cutoff=5.0",
                           "steps=2",
                           f"output.dir={tmp_path / 'md'}"], "non-finite charges")
        assert not (tmp_path / "md").exists()


# ------------------------------------------------------------ where files go and come from
def test_export_under_a_file_is_refused_before_any_work(tmp_path, capsys):
    from xnn.models import build
    from xnn.models.serialization import export_model, save_model

    model = save_model(build("lj", sigma=2.3, epsilon=0.4, cutoff=3.0), tmp_path / "lj.pt")
    afile = tmp_path / "afile"
    afile.write_text("keep\n")
    cli_fails(capsys, ["export", model, "--out", afile / "b.pt2"], "--out",
              f"{str(afile)!r} is a file, not a folder")
    cli_fails(capsys, ["export", model, "--format", "torchscript", "--out", tmp_path],
              "is a folder", "model.pt'")
    for fmt in ("energies", "torchscript"):
        msg = raises_one_line(InputError, export_model, build("lj", sigma=2.3, epsilon=0.4,
                                                              cutoff=3.0),
                              afile / "sub" / "x.pt2", format=fmt)
        assert "is a file, not a folder" in msg
    assert afile.read_text() == "keep\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "lj.pt"]


def test_a_folder_given_as_a_file_is_called_a_directory(tmp_path, cu_data, capsys):
    from xnn.config.loader import ConfigError, load_config
    from xnn.config.train import TrainConfig
    from xnn.data import read
    from xnn.errors import DataFileError, ModelFileError
    from xnn.models import build
    from xnn.models.serialization import load_model, save_model

    folder = tmp_path / "folder"
    folder.mkdir()
    run = tmp_path / "run"  # a training run's folder, given where its model.pt was meant
    run.mkdir()
    lj = save_model(build("lj", sigma=2.3, epsilon=0.4, cutoff=3.0), run / "model.pt")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.pt").write_bytes(b"")
    wf = tmp_path / "wf.yaml"
    wf.write_text(f"structure: {folder}\nmodel: {{file: {lj}}}\nstages: [{{type: relax}}]\n")
    out = tmp_path / "out"
    lj_md = ["model.name=lj", "model.hyperparameters={sigma: 2.3, epsilon: 0.4}",
             "model.cutoff=3.0", f"output.dir={out}"]
    is_dir = f"{str(folder)!r} is a directory, not a file"
    meant = f"did you mean {str(lj)!r}?"
    cases = [
        # training reads a folder of shards (OMat24's layout): an empty one names the suffixes
        (["train", f"data.datasets.0.path={folder}", f"output_dir={out}"],
         f"dataset folder {str(folder)!r} holds no dataset file (.aselmdb"),
        (["train", folder], f"config file {is_dir}"),
        (["train", f"data.datasets.0.path={cu_data}", f"pretrained={run}",
          f"output_dir={out}"], f"pretrained={str(run)!r} is a directory", meant),
        (["train", f"data.datasets.0.path={cu_data}", f"resume={run}", f"output_dir={out}"],
         f"did you mean {str(run / 'checkpoints' / 'last.pt')!r}?"),
        (["md", f"structure={folder}", *lj_md], f"structure file {is_dir}"),
        (["md", f"structure={cu_data}", f"model.file={run}", f"output.dir={out}"],
         f"model file {str(run)!r} is a directory", meant),
        (["md", f"structure={cu_data}", *lj_md, f"resume={folder}"], f"checkpoint {is_dir}"),
        (["relax", f"structure={folder}", *lj_md], is_dir),
        (["eval", run, cu_data], meant),
        (["eval", lj, folder], f"dataset folder {str(folder)!r} holds no dataset file"),
        (["export", folder], is_dir),
        (["validate", "--model", run, "--structure", cu_data, "--device", "cpu"], meant),
        (["validate", "--model", lj, "--structure", folder, "--device", "cpu"], is_dir),
        (["data", "convert", folder, tmp_path / "x.h5"],
         f"dataset folder {str(folder)!r} holds no dataset file"),
        (["run", wf], is_dir),
    ]
    for args, *words in cases:
        line = cli_fails(capsys, args, *words)
        assert "not found" not in line and "does not exist" not in line, line
    assert not out.exists()
    # a folder holding files: the message names one
    (folder / "cu.xyz").write_text("")
    cli_fails(capsys, ["md", f"structure={folder}", *lj_md],
              f"give a file in it, e.g. {str(folder / 'cu.xyz')!r}")
    # the Python API says the same
    raises_one_line(DataFileError, read, folder, match="is a directory, not a file")
    raises_one_line(ModelFileError, load_model, run, match="did you mean")
    raises_one_line(ConfigError, load_config, TrainConfig, folder, match="is a directory")


def test_missing_model_hyperparameters_are_named(tmp_path, cu_data, capsys):
    from xnn.models import build

    msg = raises_one_line(InputError, build, "lj", sigma=2.3)
    assert "model 'lj' needs hyperparameter(s) ['epsilon', 'cutoff']" in msg
    out = tmp_path / "md"
    cli_fails(capsys, ["md", f"structure={cu_data}", "model.name=lj", f"output.dir={out}"],
              "['sigma', 'epsilon', 'cutoff']", "model.hyperparameters")
    cli_fails(capsys, ["md", f"structure={cu_data}",
                       "model.name=sum", "model.hyperparameters={terms: [{name: lj, sigma: 2.3, "
                       "epsilon: 0.4, cutoff: 5.0}, {name: morse, D: 0.3}]}",
                       f"output.dir={out}"],
              "model 'morse' needs hyperparameter(s) ['alpha', 'r0', 'cutoff']")
    assert not out.exists()

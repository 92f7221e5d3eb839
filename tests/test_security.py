"""No file runs code when xnn loads it.

Every load path (``xnn.load_model``, ``pretrained=``, training ``resume=``, MD and relax
``resume=``, ``xnn md model.file=``, ``xnn eval``, ``xnn validate --model``, the MACE and
SevenNet wrappers given a path) is handed malicious files: a plain pickle, a torch file, and
legit-looking xnn files (model file, MACE model file of the earlier pickled format, training
checkpoint, MD and relax checkpoints) with an object inside whose unpickling creates a marker
file. The marker must not appear, and each path must fail with one clear line (the CLI: exit
status 2, one line on stderr, no traceback).
"""

from __future__ import annotations

import io
import pickle
import warnings

import ase.io
import pytest
import torch
from helpers import rattled_argon

import xnn
from xnn.cli.main import main
from xnn.data.emt import write_emt
from xnn.errors import XnnError
from xnn.models import build
from xnn.models.serialization import model_payload

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["model.cutoff=3.0", "model.hyperparameters={num_features: 8, num_filters: 8, "
        "num_interactions: 1, num_basis: 8}", "logging.plots=false",
        "logging.progress_bar=false", "device=cpu", "max_steps=1", "data.batch_size=3"]
LJ = ["model.name=lj", "model.hyperparameters.sigma=3.405", "model.hyperparameters.epsilon=0.0104",
      "model.cutoff=6.5", "output.progress=false", "output.plot=false"]


class Payload:
    """Unpickling this calls ``open(marker, "w")``: the marker file appears."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _schnet_payload() -> dict:
    torch.manual_seed(0)
    model = build("schnet", species=[29], cutoff=3.0, num_features=8, num_filters=8,
                  num_interactions=1, num_basis=8)
    return model_payload(model)


NAMES = ["plain pickle", "torch file", "model file", "mace model file", "training checkpoint",
         "md checkpoint", "relax checkpoint"]


def _blob(name: str, evil: Payload, model: dict) -> bytes:
    if name == "plain pickle":
        return pickle.dumps(evil)
    if name == "torch file":
        return _torch_bytes(evil)
    if name == "model file":
        return _torch_bytes({**model, "hparams": {**model["hparams"], "x": evil}})
    if name == "mace model file":  # the format of earlier xnn versions: the module pickled
        header = {k: v for k, v in model.items() if k not in ("hparams", "state_dict")}
        return _torch_bytes({**header, "name": "mace", "kind": "mace-torch-pickle",
                             "head": None, "module_bytes": _torch_bytes(evil)})
    if name == "training checkpoint":
        net = {"name": "schnet", "hparams": model["hparams"], "state_dict": model["state_dict"]}
        return _torch_bytes({"format": "xnn-checkpoint", "format_version": 1, "model": net,
                             "rng": {"torch": torch.get_rng_state(), "numpy": evil}})
    kind = name.split()[0]  # md / relax checkpoint
    return _torch_bytes({"format": "xnn-md-checkpoint", "version": 1, "meta": {"kind": kind},
                         "rng": evil})


def malicious_files(folder) -> dict:
    """Name -> ``(path, marker)``: files whose unpickling creates their ``marker`` file."""
    model = _schnet_payload()
    out = {}
    for i, name in enumerate(NAMES):
        path, marker = folder / f"file{i}.pt", folder / f"code-ran-{i}"
        path.write_bytes(_blob(name, Payload(marker), model))
        out[name] = (path, marker)
    return out


def _ran_code(files: dict) -> list[str]:
    return [name for name, (_, marker) in files.items() if marker.exists()]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    write_emt(d / "cu.xyz", 8, ["Cu"], seed=0)
    ase.io.write(d / "ar.xyz", [rattled_argon(seed=0)])
    return d


def _cli(kind, f, inputs, out):
    data, argon = inputs / "cu.xyz", inputs / "ar.xyz"
    train = ["train", f"data.datasets.0.path={data}", f"output_dir={out}", *TINY]
    md = ["md", f"structure={argon}", f"output.dir={out}", "steps=2", "ensemble=nve",
          "temperature=10"]
    return {
        "train pretrained=": train + [f"pretrained={f}"],
        "train resume=": train + [f"resume={f}"],
        "md resume=": md + LJ + [f"resume={f}"],
        "relax resume=": ["relax", f"structure={argon}", f"output.dir={out}", *LJ,
                          f"resume={f}"],
        "md model.file=": md + [f"model.file={f}", "output.progress=false"],
        "eval": ["eval", str(f), str(data), "--device", "cpu", "--plot", str(out / "p.png")],
        "validate --model": ["validate", "--model", str(f), "--structure", str(argon),
                             "--device", "cpu"],
    }[kind]


CLI_PATHS = ["train pretrained=", "train resume=", "md resume=", "relax resume=",
             "md model.file=", "eval", "validate --model"]


@pytest.mark.parametrize("kind", CLI_PATHS)
def test_cli_runs_no_code_from_files(kind, inputs, tmp_path, capsys, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    files, results = malicious_files(tmp_path), {}
    for name, (f, _) in files.items():
        capsys.readouterr()
        with warnings.catch_warnings(record=True) as caught:  # printed on stderr by the CLI
            warnings.simplefilter("always")
            try:
                rc = main(_cli(kind, f, inputs, tmp_path / f"out-{f.stem}"))
            except Exception as err:  # noqa: BLE001 - a traceback: checked below
                rc = err
        noise = [str(w.message)[:80] for w in caught if "pickle" in str(w.message)]
        results[name] = (rc, capsys.readouterr().err.strip().splitlines(), noise)
    assert _ran_code(files) == [], f"{kind} ran code from these files"
    for name, (rc, err, noise) in results.items():
        assert rc == 2, (name, rc, err)
        assert len(err) == 1 and err[0].startswith(f"xnn {kind.split()[0]}: error: "), (name, err)
        assert "Traceback" not in err[0] and "\x1b" not in err[0], (name, err)
        assert not noise, (name, noise)


def _load_model(f):
    return xnn.load_model(f)


def _mace_model_file(f):
    pytest.importorskip("mace")
    return build("mace", model=str(f))


def _sevenn_checkpoint(f):
    pytest.importorskip("sevenn")
    return build("sevenn", checkpoint=str(f))


@pytest.mark.parametrize("load", [_load_model, _mace_model_file, _sevenn_checkpoint],
                         ids=["xnn.load_model", "mace model=PATH", "sevenn checkpoint=PATH"])
def test_api_runs_no_code_from_files(load, tmp_path):
    files, errors = malicious_files(tmp_path), {}
    for name, (f, _) in files.items():
        try:
            load(f)
        except Exception as err:  # noqa: BLE001 - checked below
            errors[name] = err
    assert _ran_code(files) == [], f"{load.__name__} ran code from these files"
    for name, (f, _) in files.items():
        err = errors.get(name)
        assert isinstance(err, XnnError), (name, err)
        assert "\n" not in str(err) and str(f) in str(err), (name, err)


def test_pickled_files_load_only_with_trust(inputs, tmp_path, capsys, monkeypatch):
    """The refusal says how to load a trusted file; with the flag (API, xnn eval/validate
    --trust-file, xnn md model.trust_file=true) the file is unpickled: the flag is what
    stands between a file and its code."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    f, marker = malicious_files(tmp_path)["mace model file"]
    with pytest.raises(XnnError, match="trust=True.*--trust-file.*model.trust_file=true"):
        xnn.load_model(f)
    assert not marker.exists()
    pytest.importorskip("mace")
    with pytest.raises(XnnError):
        xnn.load_model(f, trust=True)  # not a MACE model in the end, but it was unpickled
    assert marker.exists()
    flags = {"eval": "--trust-file", "validate --model": "--trust-file",
             "md model.file=": "model.trust_file=true"}
    for i, (kind, flag) in enumerate(flags.items()):
        folder = tmp_path / f"flag{i}"
        folder.mkdir()
        f, marker = malicious_files(folder)["mace model file"]
        assert main(_cli(kind, f, inputs, folder / "out") + [flag]) == 2
        assert marker.exists(), kind

"""Trust comes only from the caller: a file that asks for it is refused through every door.

The files here pass ``torch.load(weights_only=True)``: they are data. A ``sum`` model file's
hyperparameters list a term that asks xnn to unpickle another file (``{name: mace, model:
PATH, trust: true}``, the same without ``trust``, a SevenNet checkpoint file, a ``model_file``
of an earlier xnn's pickled MACE format), or its term-by-term payload holds that earlier
format; a training checkpoint's ``model.hparams`` do the same. Unpickling the named file
creates a marker file; in one variant it then returns a real MACE model, so that a run would
finish normally. Every door (``xnn.load_model``, ``xnn md`` with ``model.file``,
a sum's ``model.hyperparameters.terms`` (alone and after a built-in term), the ranks'
loader of decomposed ``xnn md``,
``xnn relax``, ``xnn eval``, ``xnn validate``, ``xnn export``, ``xnn train pretrained=``
with a model file and with a checkpoint, ``xnn run``, the torch-sim and LAMMPS bridges) must
refuse each file with one line naming it and saying how the caller grants trust, and no
marker may appear. With the caller's trust (``trust=True``, ``--trust-file``,
``model.trust_file=true``) the same door loads the file: the marker appears and the run ends.
"""

from __future__ import annotations

import io
import operator
import warnings
from pathlib import Path

import ase.io
import numpy as np
import pytest
import torch
from ase.build import bulk

import xnn
from xnn.cli.main import main
from xnn.data.emt import write_emt
from xnn.errors import TrustError, XnnError
from xnn.models import Sum, build
from xnn.models.serialization import model_payload, save_model

pytestmark = pytest.mark.usefixtures("one_thread")

ASKS = "a file cannot grant trust"  # every refusal says so, and how the caller grants it
MD = ["steps=2", "ensemble=nve", "temperature=10", "model.device=cpu", "output.progress=false",
      "output.plot=false"]
LJ_CU = {"sigma": 2.3, "epsilon": 0.4, "cutoff": 5.0}


class Marker:
    """Unpickling this creates the file ``path``: proof that code from a file ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class MarkedModel:
    """Unpickles to ``model`` after creating the file ``path``: code that runs unnoticed."""

    def __init__(self, path, model):
        self.path, self.model = str(path), model

    def __reduce__(self):
        return (operator.getitem, ((Marker(self.path), self.model), 1))


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _header() -> dict:
    """The entries of an xnn model file other than the model (format, version, units...)."""
    payload = model_payload(build("lj", **LJ_CU))
    header = {k: v for k, v in payload.items() if k not in ("hparams", "state_dict")}
    return {**header, "dtype": "float64"}


def _has(extra: str) -> bool:
    from xnn.models.external._optional import MissingExtraError, import_extra

    try:
        import_extra(extra, extra)
    except MissingExtraError:
        return False
    return True


def _tiny_mace():
    """A random-weight mace-torch ScaleShiftMACE for Si and Cu (float64), or None."""
    try:
        from xnn.models.external._optional import import_extra

        (modules,) = import_extra("mace", "mace.modules")
        from e3nn import o3
    except Exception:  # noqa: BLE001 - the extra is optional: its variants are left out
        return None
    torch.manual_seed(0)
    block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    return modules.ScaleShiftMACE(
        r_max=3.2, num_bessel=6, num_polynomial_cutoff=5, max_ell=2, interaction_cls=block,
        interaction_cls_first=block, num_interactions=2, num_elements=2,
        hidden_irreps=o3.Irreps("8x0e + 8x1o"), MLP_irreps=o3.Irreps("8x0e"),
        gate=torch.nn.functional.silu, atomic_energies=np.array([-1.5, -3.25]),
        avg_num_neighbors=8.0, atomic_numbers=[14, 29], correlation=2,
        atomic_inter_scale=1.3, atomic_inter_shift=0.2).double().eval()


class Workspace:
    """Structures, data, the malicious files (``variants``: name -> (file, marker)) and the
    files that load when the caller trusts them (``trusted_mace``, ``trusted_native``)."""

    def __init__(self, d: Path):
        self.d = d
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)
        atoms.rattle(0.02, seed=1)
        ase.io.write(d / "cu32.xyz", atoms)
        write_emt(d / "cu.xyz", 6, ["Cu"], seed=0)
        self.header = _header()
        torch.manual_seed(0)
        self.schnet = save_model(build("schnet", species=[29], cutoff=3.0, num_features=8,
                                       num_filters=8, num_interactions=1, num_basis=8),
                                 d / "schnet.pt")
        self.variants = self._variants()
        self.trusted_native = self._sum_file("trusted-native", [{"model_file": str(self.schnet)}],
                                             Sum([xnn.load_model(self.schnet)]).state_dict())
        lj = save_model(build("lj", **LJ_CU).double(), d / "lj.pt")
        self.trusted_lj = self._sum_file("trusted-lj", [{"model_file": str(lj)}],
                                         Sum([xnn.load_model(lj)]).state_dict())
        mace = _tiny_mace()
        self.trusted_mace = None
        if mace is not None:
            marker = d / "ran-trusted-mace"
            real = self._pickle("real-trusted.model", MarkedModel(marker, mace))
            state = Sum([build("mace", model=mace)]).state_dict()
            self.trusted_mace = (self._sum_file("trusted-mace", [self._mace_term(real)], state),
                                 marker)
            self.variants["real MACE returned"] = self._marked(
                lambda m: [self._mace_term(self._pickle("real.model", MarkedModel(m, mace)))],
                "real", state)
        (d / "workflow.yaml").write_text(
            "index: ':'\nstages:\n  - {name: md, type: nve, steps: 2, timestep: 1}\n"
            "output: {progress: false, trajectory_every: 0}\n")

    # ----------------------------------------------------------------- files
    def _pickle(self, name: str, obj) -> Path:
        path = self.d / name
        path.write_bytes(_torch_bytes(obj))
        return path

    @staticmethod
    def _mace_term(path: Path, trust: bool | None = True) -> dict:
        term = {"name": "mace", "model": str(path)}
        return term if trust is None else {**term, "trust": trust}

    def _legacy_mace(self, marker: Path) -> dict:
        """A MACE term as earlier xnn versions stored it: the module pickled."""
        return {"name": "mace", "kind": "mace-torch-pickle", "head": None,
                "module_bytes": _torch_bytes(Marker(marker))}

    def _sum_file(self, name: str, terms: list, state: dict | None = None) -> Path:
        path = self.d / f"{name}.pt"
        path.write_bytes(_torch_bytes({**self.header, "name": "sum", "hparams": {"terms": terms},
                                       "state_dict": state or {}}))
        return path

    def _marked(self, terms_of, name: str, state: dict | None = None) -> tuple[Path, Path]:
        marker = self.d / f"ran-{name}"
        return self._sum_file(f"sum-{name}", terms_of(marker), state), marker

    def _variants(self) -> dict:
        evil = {}
        for name in ("mace", "mace-untrusted", "sevenn", "sevenn-untrusted"):
            evil[name] = self.d / f"ran-{name}"
            self._pickle(f"{name}.bin", Marker(evil[name]))
        legacy_marker = self.d / "ran-legacy"
        legacy = self.d / "legacy.pt"
        legacy.write_bytes(_torch_bytes({**self.header, **self._legacy_mace(legacy_marker)}))
        terms_marker = self.d / "ran-terms"
        by_terms = self.d / "sum-terms.pt"
        by_terms.write_bytes(_torch_bytes({**self.header, "name": "sum", "kind": "xnn-sum-terms",
                                           "terms": [self._legacy_mace(terms_marker)],
                                           "trainable": [True]}))
        variants = {
            "mace model=PATH, trust": (self._sum_file(
                "sum-mace", [self._mace_term(self.d / "mace.bin")]), evil["mace"]),
            "mace model=PATH": (self._sum_file(
                "sum-mace-untrusted", [self._mace_term(self.d / "mace-untrusted.bin", None)]),
                evil["mace-untrusted"]),
            "sevenn checkpoint=PATH, trust": (self._sum_file(
                "sum-sevenn", [{"name": "sevenn", "checkpoint": str(self.d / "sevenn.bin"),
                                "trust": True}]), evil["sevenn"]),
            "model_file of a pickled MACE, trust": (self._sum_file(
                "sum-legacy", [{"model_file": str(legacy), "trust": True}]), legacy_marker),
            "pickled MACE term": (by_terms, terms_marker),
            "sevenn checkpoint=PATH": (self._sum_file(
                "sum-sevenn-untrusted", [{"name": "sevenn",
                                          "checkpoint": str(self.d / "sevenn-untrusted.bin")}]),
                evil["sevenn-untrusted"]),
            "model_file": (self._sum_file("sum-native", [{"model_file": str(self.schnet)}]),
                           None),
        }
        # without `trust` the wrapper itself refuses, after importing its package
        needs = {"mace model=PATH": "mace", "pickled MACE term": "mace",
                 "sevenn checkpoint=PATH": "sevenn"}
        return {k: v for k, v in variants.items() if k not in needs or _has(needs[k])}

    def checkpoint_of(self, model_file: Path) -> Path:
        """A training checkpoint whose ``model`` is the sum of ``model_file`` (as data)."""
        payload = torch.load(model_file, weights_only=True)
        path = model_file.with_name(f"ckpt-{model_file.name}")
        path.write_bytes(_torch_bytes({
            "format": "xnn-checkpoint", "format_version": 1,
            "model": {"name": "sum", "hparams": payload["hparams"],
                      "state_dict": payload["state_dict"]}}))
        return path


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("trust"))


# ----------------------------------------------------------------------------- doors
# each door: (workspace, file, trust, out folder) -> None, raising XnnError (an API door)
# or returning the CLI's exit status and error lines (a CLI door)
def _cli(argv: list[str]):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main([str(a) for a in argv])


def _md(ws, f, trust, out, how):
    base = ["md", f"structure={ws.d / 'cu32.xyz'}", f"output.dir={out}", *MD]
    flag = ["model.trust_file=true"] if trust else []
    if how == "file":
        return _cli(base + [f"model.file={f}", *flag])
    terms = [f"{{model_file: {f}}}"]
    if how == "add":  # the file as a term added to a built-in model
        terms.insert(0, "{name: lj, " + ", ".join(f"{k}: {v}" for k, v in LJ_CU.items()) + "}")
    return _cli(base + ["model.name=sum", f"model.hyperparameters.terms=[{', '.join(terms)}]",
                        *flag])


def _relax(ws, f, trust, out):
    return _cli(["relax", f"structure={ws.d / 'cu32.xyz'}", f"output.dir={out}",
                 f"model.file={f}", "model.device=cpu", "max_steps=2", "output.progress=false",
                 *(["model.trust_file=true"] if trust else [])])


def _eval(ws, f, trust, out):
    return _cli(["eval", f, ws.d / "cu.xyz", "--device", "cpu", "--plot", out.with_suffix(".png"),
                 *(["--trust-file"] if trust else [])])


def _validate(ws, f, trust, out):
    return _cli(["validate", "--model", f, "--structure", ws.d / "cu32.xyz", "--device", "cpu",
                 *(["--trust-file"] if trust else [])])


def _export(ws, f, trust, out):
    return _cli(["export", f, "--format", "torchscript", "--out", out / "m.pt",
                 *(["--trust-file"] if trust else [])])


def _train(ws, f, trust, out, checkpoint=False):
    if checkpoint:
        f = ws.checkpoint_of(f)
    return _cli(["train", f"data.datasets.0.path={ws.d / 'cu.xyz'}", f"output_dir={out}",
                 f"pretrained={f}", "model.cutoff=3.0", "logging.plots=false",
                 "logging.progress_bar=false", "device=cpu", "max_steps=1", "data.batch_size=2",
                 *(["model.trust_file=true"] if trust else [])])


def _run(ws, f, trust, out):
    return _cli(["run", ws.d / "workflow.yaml", f"structure={ws.d / 'cu32.xyz'}",
                 f"output.dir={out}", f"model.file={f}", "model.device=cpu",
                 *(["model.trust_file=true"] if trust else [])])


def _ranks_md(ws, f, trust, out):
    """The path of ``torchrun -m xnn md``: every rank runs ``_run_md`` with its manager."""
    from xnn.app.md import _run_md
    from xnn.distributed import DistributedManager

    manager = DistributedManager.initialize(device="cpu")
    _run_md(None, [f"structure={ws.d / 'cu32.xyz'}", f"output.dir={out}", *MD,
                   f"model.file={f}", *(["model.trust_file=true"] if trust else [])], manager)


def _load_model(ws, f, trust, out):
    xnn.load_model(f, trust=trust)


def _trust_kw(trust: bool) -> dict:
    """``trust=True`` when the caller trusts the file; else the call as users write it."""
    return {"trust": True} if trust else {}


def _torchsim(ws, f, trust, out):
    import torch_sim as ts

    from xnn.interop.torchsim import XnnTorchSimModel

    model = XnnTorchSimModel(f, device="cpu", dtype=torch.float64, **_trust_kw(trust))
    atoms = ase.io.read(ws.d / "cu32.xyz")
    out = model(ts.io.atoms_to_state([atoms], torch.device("cpu"), torch.float64))
    assert torch.isfinite(out["energy"]).all()


def _lammps(ws, f, trust, out):
    from xnn.interop.lammps import XnnFixExternal, require_lammps

    lmp = require_lammps().lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"])
    atoms = ase.io.read(ws.d / "cu32.xyz")
    side = float(atoms.cell[0, 0])
    lmp.commands_string(f"units metal\natom_modify map yes\nregion box block 0 {side!r} 0 "
                        f"{side!r} 0 {side!r} units box\ncreate_box 1 box\nmass 1 63.546")
    n = len(atoms)
    lmp.create_atoms(n, list(range(1, n + 1)), [1] * n, atoms.positions.reshape(-1).tolist())
    try:
        fix = XnnFixExternal(lmp, f, species=["Cu"], **_trust_kw(trust))
        fix.run(0)
        assert np.isfinite(fix.energy)
    finally:
        lmp.close()


DOORS = {
    "xnn.load_model": _load_model,
    "md model.file": lambda ws, f, t, o: _md(ws, f, t, o, "file"),
    "md sum of lj and the file": lambda ws, f, t, o: _md(ws, f, t, o, "add"),
    "md model.hyperparameters.terms": lambda ws, f, t, o: _md(ws, f, t, o, "terms"),
    "md on the ranks": _ranks_md,
    "relax": _relax,
    "eval": _eval,
    "validate": _validate,
    "export": _export,
    "train pretrained=model file": _train,
    "train pretrained=checkpoint": lambda ws, f, t, o: _train(ws, f, t, o, checkpoint=True),
    "run": _run,
    "torch-sim": _torchsim,
    "lammps": _lammps,
}
# the file that loads with the caller's trust: the MACE one (its code runs: the marker
# appears), or where the door takes only native models (fine-tuning) or exporting MACE would
# take long, a sum that names a native model file (loaded only when the caller trusts it)
NATIVE_DOORS = {"export": "trusted_lj", "train pretrained=model file": "trusted_native",
                "train pretrained=checkpoint": "trusted_native"}


def _require(door: str) -> None:
    """Skip a bridge's door when its toolkit is not installed."""
    if door == "torch-sim":
        pytest.importorskip("torch_sim")
    if door == "lammps":
        from xnn.interop.lammps import require_lammps

        try:
            require_lammps().lammps(cmdargs=["-log", "none", "-screen", "none"]).close()
        except (XnnError, OSError) as err:
            pytest.skip(f"LAMMPS unavailable: {err}")


def _variants(door: str, ws: Workspace) -> dict:
    """The malicious files this door takes (a training checkpoint stores hyperparameters,
    never a term-by-term payload)."""
    if "checkpoint" not in door:
        return ws.variants
    return {k: v for k, v in ws.variants.items() if k != "pickled MACE term"}


def _attempt(door: str, ws: Workspace, f: Path, trust: bool, out: Path, capsys) -> str | None:
    """Run ``door`` on ``f``: ``None`` if it succeeded, else its one error line."""
    capsys.readouterr()
    try:
        rc = DOORS[door](ws, f, trust, out)
    except XnnError as err:
        assert "\n" not in str(err), (door, str(err))
        return str(err)
    err = capsys.readouterr().err.strip().splitlines()
    if rc in (None, 0):
        return None
    assert rc == 2 and len(err) == 1, (door, rc, err)
    return err[0]


@pytest.mark.parametrize("door", list(DOORS))
def test_files_asking_for_trust_are_refused(door, ws, tmp_path, capsys, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    _require(door)
    variants, errors = _variants(door, ws), {}
    for _, marker in variants.values():
        if marker is not None:
            marker.unlink(missing_ok=True)  # each door on its own (a marker is never expected)
    for k, (name, (f, _)) in enumerate(variants.items()):
        errors[name] = (f, _attempt(door, ws, f, False, tmp_path / f"out{k}", capsys))
    ran = [name for name, (_, marker) in variants.items() if marker and marker.exists()]
    assert ran == [], f"{door} ran code from these files"
    for name, (f, err) in errors.items():
        shown = f.with_name(f"ckpt-{f.name}") if "checkpoint" in door else f
        assert err is not None, (door, name, "loaded")
        assert str(shown) in err and ASKS in err, (door, name, err)
        assert "--trust-file" in err and "model.trust_file=true" in err, (door, name, err)
    assert not any((tmp_path / f"out{k}").exists() for k in range(len(ws.variants))), \
        f"{door} wrote its output folder before refusing"


@pytest.mark.parametrize("door", list(DOORS))
def test_the_callers_trust_loads_them(door, ws, tmp_path, capsys, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    _require(door)
    if door in NATIVE_DOORS:
        f, marker = getattr(ws, NATIVE_DOORS[door]), None
    elif ws.trusted_mace is None:
        pytest.skip("mace-torch is not installed")
    else:
        f, marker = ws.trusted_mace
    err = _attempt(door, ws, f, True, tmp_path / "out", capsys)
    assert err is None, (door, err)
    assert marker is None or marker.exists(), f"{door}: the caller's trust did not reach it"


def test_a_files_trust_counts_for_nothing_with_python_calls(ws):
    """The library calls under the doors: a nested ``trust=True`` written in a file is not
    the caller's, and the caller's holds for every nested load."""
    from xnn.training.setup import load_pretrained

    f, marker = ws.variants["mace model=PATH, trust"]
    with pytest.raises(TrustError, match=ASKS):
        load_pretrained(str(f))
    with pytest.raises(TrustError, match=ASKS):
        load_pretrained(str(ws.checkpoint_of(f)))
    assert not marker.exists()
    model = load_pretrained(str(ws.checkpoint_of(ws.trusted_native)), trust=True)
    assert isinstance(model.terms[0], type(xnn.load_model(ws.schnet)))


@pytest.mark.slow  # builds SevenNet-0 twice (~15 s here)
def test_a_named_sevenn_checkpoint_needs_no_trust(tmp_path):
    """Names of checkpoints that ``sevenn`` ships are not files: a file naming one loads
    without trust, as a direct ``build("sevenn", checkpoint="7net-0")`` does."""
    if not _has("sevenn"):
        pytest.skip("sevenn is not installed")
    state = Sum([build("sevenn", checkpoint="7net-0")]).state_dict()
    path = tmp_path / "sum-7net.pt"
    path.write_bytes(_torch_bytes({**_header(), "dtype": "float32", "name": "sum",
                                   "hparams": {"terms": [{"name": "sevenn",
                                                          "checkpoint": "7net-0"}]},
                                   "state_dict": state}))
    model = xnn.load_model(path)
    assert model.terms[0].source == "7net-0"

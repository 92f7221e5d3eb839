"""Replay structures labelled by the pretrained model itself
(``finetune.replay_from_pretrained: N``).

The recipe, seeded by the run's ``seed``: structure ``i`` of ``N`` is a training structure of
the new data drawn at random (the training split only: no validation or test structure is
perturbed into replay); periodic structures are deformed by a symmetric strain ``ε`` with
components uniform in ``[-s, s]`` (``finetune.replay_strain``; positions and cell both
``x -> x (1 + ε)``), then every atom is displaced by a Gaussian of standard deviation
``finetune.replay_rattle`` Å. A draw that brings two atoms closer than ``0.7 ×`` the source
structure's shortest distance (at most the model cutoff) is redrawn; after 20 such draws the
run is refused. The pretrained model labels the structures (energy, forces, and stress of
fully periodic structures), in float64, a batch at a time.

Rank 0 makes (or, resuming, reads) the extxyz text and shares it over the data-parallel
group (with ``parallel.dd > 1`` the first rank of each dp group makes the same seeded text);
every rank builds the same dataset from that text, and rank 0 writes it into the run folder
as ``replay_pretrained.xyz`` (labels under the default keys ``energy``/``forces``/
``stress``, ``config_type=replay``, ``replay_seed``, ``replay_source``: the index into the
training split; every number written with 17 significant digits, so the file holds exactly
the structures and labels trained on).
A resumed run reads the file and never relabels; it is refused when the file is missing or
was made with another ``N``, seed, rattle or strain.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import numpy as np
import torch

from xnn.config.train import DatasetConfig, TrainConfig
from xnn.data import keys as K
from xnn.data.datasets import InMemoryDataset
from xnn.errors import DataFileError, InputError

#: the file in the run folder
FILE = "replay_pretrained.xyz"
#: seeds the replay structures apart from the splits and the training order
GEN_SEED = 15485863
#: a draw is refused when two atoms come closer than CLOSE × the source's shortest distance
CLOSE = 0.7
#: draws per structure before the run is refused
TRIES = 20
#: structures per labelling batch
BATCH = 8
KEYS = {"energy_key": "energy", "forces_key": "forces", "stress_key": "stress",
        "virial_key": "virial"}


def perturb(positions: np.ndarray, cell: np.ndarray, pbc: np.ndarray, rng,
            rattle: float, strain: float) -> tuple[np.ndarray, np.ndarray]:
    """One draw of the recipe: ``(positions [n, 3] Å, cell [3, 3] Å)``, strained (periodic
    structures) and rattled."""
    e = rng.uniform(-strain, strain, (3, 3))
    deform = np.eye(3) + (0.5 * (e + e.T) if pbc.any() else 0.0)
    noise = rng.normal(0.0, rattle, positions.shape)
    return positions @ deform + noise, cell @ deform


def _graph(numbers, positions, cell, pbc):
    from ase import Atoms

    from xnn.data.ase_io import from_ase

    atoms = Atoms(numbers=numbers, positions=positions, cell=cell, pbc=pbc)
    return from_ase(atoms, None, None, None, None)


def make_structures(potential, train, n: int, seed: int, rattle: float,
                    strain: float) -> list[tuple[int, object]]:
    """``n`` perturbed training structures: ``[(source index, one-system graph)]``.

    Args:
        potential: a :class:`~xnn.models.potential.Potential` (its cutoff bounds the
            distance check, :meth:`~xnn.models.potential.Potential.min_pair_distance`).
        train: the training structures of the new data.
    Raises:
        DataFileError: ``TRIES`` draws from one structure all bring atoms too close.
    """
    rng = np.random.default_rng([seed, GEN_SEED])
    cutoff = float(potential.neighbors.cutoff)
    out = []
    for _ in range(n):
        src = int(rng.integers(len(train)))
        g = train[src]
        numbers = g.numbers.numpy()
        pos, cell = g.positions.double().numpy(), g.cell[0].double().numpy()
        pbc = g.pbc[0].numpy()
        d0 = float(potential.min_pair_distance(_graph(numbers, pos, cell, pbc))[0])
        limit = CLOSE * min(d0, cutoff)
        for _ in range(TRIES):
            p, c = perturb(pos, cell, pbc, rng, rattle, strain)
            new = _graph(numbers, p, c, pbc)
            if float(potential.min_pair_distance(new)[0]) >= limit:
                out.append((src, new))
                break
        else:
            raise DataFileError(
                f"finetune.replay_from_pretrained: {TRIES} draws from training structure "
                f"{src} all brought two atoms closer than {limit:.3f} Å ({CLOSE} x its "
                f"shortest distance); lower finetune.replay_rattle "
                f"({rattle} Å) or finetune.replay_strain ({strain})")
    return out


def _num(x) -> str:
    return repr(float(x))


def frame_text(graph, labels: dict, info: dict) -> str:
    """One extxyz frame, every number with 17 significant digits (reads back bitwise)."""
    from ase.data import chemical_symbols

    cell, pbc = graph.cell[0].double().numpy(), graph.pbc[0].numpy()
    head = [f'Lattice="{" ".join(_num(x) for x in cell.ravel())}"',
            "Properties=species:S:1:pos:R:3:forces:R:3",
            f"energy={_num(labels[K.ENERGY])}"]
    if K.STRESS in labels:
        head.append(f'stress="{" ".join(_num(x) for x in labels[K.STRESS].reshape(-1))}"')
    head += [f"{k}={v}" for k, v in info.items()]
    head.append('pbc="' + " ".join("T" if p else "F" for p in pbc) + '"')
    rows = [f"{chemical_symbols[int(z)]} " + " ".join(_num(x) for x in (*r, *f))
            for z, r, f in zip(graph.numbers.tolist(), graph.positions.double().numpy(),
                               labels[K.FORCES].double().numpy())]
    return "\n".join([str(graph.n_atoms), " ".join(head), *rows]) + "\n"


def replay_text(model, train, n: int, seed: int, rattle: float, strain: float) -> str:
    """The extxyz text of ``n`` replay structures labelled by ``model`` (float64 where the
    model converts; see the module docstring)."""
    from xnn.models.potential import Potential, label_structures

    model = copy.deepcopy(model).to(torch.float64).eval()
    floats = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    dtype = floats[0].dtype if floats else torch.float64  # a model that keeps its own
    potential = Potential(model)
    made = make_structures(potential, train, n, seed, rattle, strain)
    labels = label_structures(potential, [g.to(dtype=dtype) for _, g in made], BATCH)
    info = {"config_type": "replay", "replay_seed": seed, "replay_rattle": _num(rattle),
            "replay_strain": _num(strain)}
    return "".join(frame_text(g, lab, {**info, "replay_source": src})
                   for (src, g), lab in zip(made, labels))


def read_frames(text: str) -> list:
    import ase.io

    return ase.io.read(io.StringIO(text), index=":", format="extxyz")


def dataset_of(text: str, path: str, weight: float) -> InMemoryDataset:
    """The replay dataset of the extxyz ``text`` of ``path`` (loss weight ``weight``)."""
    from xnn.data.sources.frames import graph_of

    graphs, offset = [], 0
    for k, atoms in enumerate(read_frames(text)):
        graphs.append(graph_of(atoms, k, offset, KEYS, weight, path))
        offset += len(atoms)
    return InMemoryDataset(graphs, name=FILE, source=path)


def check_recipe(text: str, path: str, n: int, seed: int, rattle: float, strain: float) -> None:
    """A replay file made for this run: ``n`` structures of this seed, rattle and strain.

    Raises:
        DataFileError: one line naming what differs.
    """
    frames = read_frames(text)
    want = {"replay_seed": seed, "replay_rattle": rattle, "replay_strain": strain}
    got = {k: (frames[0].info.get(k) if frames else None) for k in want}
    same = all(f.info.get(k) == v for f in frames for k, v in want.items())
    if len(frames) != n or not same:
        raise DataFileError(
            f"{path} holds {len(frames)} replay structures of {got}, the config asks for "
            f"finetune.replay_from_pretrained={n} of {want}: resume with the settings of the "
            "run, or start a new run")


class PretrainedReplay:
    """The ``replay_from_pretrained`` structures of one run (see the module docstring).

    Args:
        cfg: the run's config (``pretrained``, ``seed``, ``finetune``).
        work: the run folder being written (``replay_pretrained.xyz`` lands there).
        resume: the checkpoint the run continues from (``None``: a new run).
        reducer: the ranks of the run (``rank``, ``is_main``, ``gather_objects``).
    """

    def __init__(self, cfg: TrainConfig, work: Path, resume: str | None, reducer):
        self.cfg, self.work, self.resume, self.reducer = cfg, Path(work), resume, reducer
        self.text: str | None = None

    @property
    def path(self) -> Path:
        return self.work / FILE

    def entry(self) -> DatasetConfig:
        """Its ``data.replay``-like entry (weight 1: ``finetune.replay_weight`` applies)."""
        return DatasetConfig(path=str(self.path))

    def dataset(self, train) -> InMemoryDataset:
        """Make (rank 0; a resumed run reads the file) and share the structures; every rank
        returns the same dataset (loss weight ``finetune.replay_weight``).

        Args:
            train: the training structures of the new data (every rank passes the same).
        Raises:
            DataFileError: see :func:`make_structures`, :func:`check_recipe`; a resumed run
                whose run folder has no replay file.
        """
        made, error = None, None
        if self.reducer.rank == 0:  # the job's rank 0 (with dd > 1: each dp group's first)
            try:
                made = self._text(train)
            except (DataFileError, InputError) as e:
                error = (type(e), str(e))
        made, error = self.reducer.gather_objects((made, error))[0]
        if error is not None:
            raise error[0](error[1])
        self.text = made
        return dataset_of(made, str(self.path), self.cfg.finetune.replay_weight)

    def _text(self, train) -> str:
        ft = self.cfg.finetune
        recipe = (ft.replay_from_pretrained, self.cfg.seed, ft.replay_rattle, ft.replay_strain)
        if self.resume is None:
            return replay_text(self._model(), train, *recipe)
        found = [p for p in (self.path, Path(self.resume).resolve().parents[1] / FILE)
                 if p.is_file()]
        if not found:
            raise DataFileError(f"resuming a run with finetune.replay_from_pretrained: "
                                f"{self.path} is missing (a resumed run never relabels); "
                                "start a new run")
        text = found[0].read_text()
        check_recipe(text, str(found[0]), *recipe)
        return text

    def _model(self) -> torch.nn.Module:
        from xnn.models.trust import granted
        from xnn.training.setup import load_pretrained

        with granted(self.cfg.model.trust_file):
            return load_pretrained(self.cfg.pretrained)

    def write(self) -> None:
        """Rank 0 writes the file into the run folder (once: a resumed run's file stays)."""
        if self.reducer.is_main and self.text is not None and not self.path.is_file():
            tmp = self.path.with_name(f".{FILE}.tmp")
            tmp.write_text(self.text)
            tmp.replace(self.path)


__all__ = ["PretrainedReplay", "FILE", "replay_text", "make_structures", "perturb"]

"""The model of a training run from the config: hyperparameters, data statistics, a new
model, or a check that a pretrained model agrees with the config's ``model`` section."""

from __future__ import annotations

import inspect
import json
import math

import numpy as np
import torch
from torch import nn

from xnn.config.model import ModelConfig, train_model_default
from xnn.config.train import TrainConfig
from xnn.errors import InputError
from xnn.models.base import as_model
from xnn.models.registry import build, model_class
from xnn.training.data import symbols


def _accepts(name: str, arg: str) -> bool:
    params = inspect.signature(model_class(name).__init__).parameters
    return arg in params


def model_hyperparameters(cfg: ModelConfig, species: list[int], avg_neighbors=None) -> dict:
    """Keyword arguments for ``xnn.models.build``: config hyperparameters plus species, cutoff
    and (for models that take it, unless set) the average number of neighbours.

    ``avg_neighbors``: a number, or for ``model.name=sum`` a ``{cutoff: average}`` dict."""
    hp = dict(cfg.hyperparameters)
    for key in ("species", "cutoff", "activation_checkpointing"):
        if key in hp:
            raise InputError(f"set model.{key} rather than model.hyperparameters.{key}")
    if cfg.name == "sum":
        return sum_hyperparameters(cfg, species, avg_neighbors)
    # as for a sum's terms: only to the classes that take them (d3 and ewald have no
    # species, so that check_trainable can say what is wrong with training them)
    for key, value in (("species", list(species)), ("cutoff", float(cfg.cutoff))):
        if _accepts(cfg.name, key):
            hp[key] = value
    if avg_neighbors is not None and "avg_num_neighbors" not in hp \
            and _accepts(cfg.name, "avg_num_neighbors"):
        hp["avg_num_neighbors"] = float(avg_neighbors)
    return hp


def _term_cutoff(cfg: ModelConfig, spec: dict) -> float:
    """A named sum term's cutoff: its own or ``model.cutoff`` (which must cover it)."""
    cut = float(spec.get("cutoff", cfg.cutoff))
    if cut > float(cfg.cutoff) * (1 + 1e-12):
        raise InputError(f"sum term {spec.get('name')!r} has cutoff {cut:g} Å > model.cutoff "
                         f"{float(cfg.cutoff):g}: the data's neighbor lists use model.cutoff; "
                         f"set model.cutoff to at least {cut:g}")
    return cut


def sum_terms(cfg: ModelConfig) -> list:
    """The ``terms`` list of a ``model.name=sum`` config (refused when missing)."""
    terms = cfg.hyperparameters.get("terms")
    if not isinstance(terms, (list, tuple)) or not terms:
        raise InputError("model.name=sum needs model.hyperparameters.terms: a list of "
                         "{name: ..., ...} or {model_file: ...} terms")
    return [dict(t) if isinstance(t, dict) else t for t in terms]


def sum_hyperparameters(cfg: ModelConfig, species: list[int], avg_neighbors=None) -> dict:
    """``terms`` of a sum for ``xnn train``: each named term gets ``species`` and, unless it
    sets them, ``cutoff = model.cutoff`` and the average number of neighbours within its
    cutoff (for the classes that take them); model files are used as they are."""
    hp = dict(cfg.hyperparameters)
    terms = []
    for spec in sum_terms(cfg):
        if isinstance(spec, dict) and "name" in spec:
            spec = dict(spec)
            cut = _term_cutoff(cfg, spec)
            for key, value in (("species", list(species)), ("cutoff", cut)):
                if key not in spec and _accepts(spec["name"], key):
                    spec[key] = value
            if isinstance(avg_neighbors, dict) and "avg_num_neighbors" not in spec \
                    and _accepts(spec["name"], "avg_num_neighbors") and cut in avg_neighbors:
                spec["avg_num_neighbors"] = float(avg_neighbors[cut])
        terms.append(spec)
    hp["terms"] = terms
    return hp


def shared_average_neighbors(structures: list, cutoffs: list[float], reducer=None,
                             origin=None) -> list:
    """The average number of neighbours within each of ``cutoffs`` over ``structures``, with
    the neighbor lists shared by the ranks of ``reducer`` (each builds those of every
    ``world_size``-th structure; one gather of the counts): the same numbers on every rank,
    and as one process computes them. Collective over ``reducer``'s ranks.

    The same lists refuse a structure with coincident atoms: every rank raises the
    :func:`~xnn.neighbors.datasets.coincident_error` of the first such structure, named by
    ``origin(k) -> (file, index in file)`` of ``structures[k]`` (default: the sample's
    ``("statistics sample", k)``)."""
    from xnn.models import statistics as S

    rank, world = (0, 1) if reducer is None else (reducer.rank, reducer.world_size)
    mine = [S.neighbor_counts(structures[rank::world], c) for c in cutoffs]
    every = reducer.gather_objects(mine) if world > 1 else [mine]
    _refuse_coincident(every, world, origin or (lambda k: ("statistics sample", k)))
    out = []
    for k in range(len(cutoffs)):
        edges, atoms = (sum(r[k][i] for r in every) for i in (0, 1))
        if atoms == 0:
            raise InputError("average_num_neighbors needs at least one atom")
        out.append(edges / atoms)
    return out


def _refuse_coincident(every: list, world: int, origin) -> None:
    """Raise for the first structure (by sample position) in which a rank's lists
    (``every[rank][cutoff]``, :class:`~xnn.models.statistics.NeighborCounts` of the sample's
    structures ``rank::world``) found coincident atoms."""
    from xnn.neighbors.datasets import coincident_error

    found = [(rank + world * c.close.system, c.close) for rank, counts in enumerate(every)
             for c in counts[:1] if c.close is not None]
    if found:
        k, pair = min(found, key=lambda f: f[0])
        raise coincident_error(*origin(k), pair)


def data_statistics(cfg: ModelConfig, species: list[int], structures: list,
                    reducer=None, origin=None,
                    isolated: dict[int, float] | None = None) -> dict:
    """E0s, shift, scale and average neighbours from training structures (see ModelConfig).

    For ``model.name=sum`` the energies and forces are those left by the fixed terms
    (``trainable: false``: delta learning fits the trainable terms' E0, shift and scale to
    the residual), plus a ``{cutoff: average number of neighbours}`` dict over the named
    terms' cutoffs in ``term_avg_num_neighbors``. The neighbor lists of the averages are
    shared by the ranks of ``reducer`` (see :func:`shared_average_neighbors`; every rank of
    it must call this function), the rest needs none. They refuse a structure with
    coincident atoms, named by ``origin(k) -> (file, index in file)`` of ``structures[k]``.
    The E0s follow ``cfg.e0`` (:func:`reference_energies`; ``isolated``: the isolated-atom
    energies of the training files, :attr:`~xnn.training.data.DataSplits.isolated_e0`)."""
    from xnn.models import statistics as S

    cuts = []
    if cfg.name == "sum":
        cuts = sorted({_term_cutoff(cfg, t) for t in sum_terms(cfg)
                       if isinstance(t, dict) and "name" in t})
    averages = shared_average_neighbors(structures, [float(cfg.cutoff), *cuts], reducer,
                                        origin)
    out: dict = {"avg_num_neighbors": averages[0]}
    if cfg.name == "sum":
        out["term_avg_num_neighbors"] = dict(zip(cuts, averages[1:]))
        structures = residual_structures(cfg, species, structures)
    e0 = reference_energies(cfg, species, structures, isolated)
    out["e0"] = e0
    if cfg.scale_shift:
        out["shift"] = S.energy_per_atom_stats(structures, e0)["mean"]
        rms = S.force_rms(structures)
        out["scale"] = rms if rms > 1e-8 else 1.0
    return out


def stored_statistics(cfg: ModelConfig, species: list[int], sample,
                      isolated: dict[int, float] | None = None) -> dict | None:
    """:func:`data_statistics` of the structures of ``sample`` from the counts stored with
    the data (the prepared format, :meth:`~xnn.data.datasets.LabelledDataset.stored_statistics`):
    no structure read, no neighbor list built (coincident atoms were refused when the data
    were prepared). ``None`` when the data store none at ``model.cutoff`` (a file of another
    format among the training data, another cutoff) or for ``model.name=sum`` (whose
    statistics need the fixed terms' predictions): then compute them.

    Args:
        sample: the statistics sample (a dataset; every structure of it is used).
    """
    from xnn.models import statistics as S

    if cfg.name == "sum":
        return None
    entries = sample.stored_statistics(np.arange(len(sample)), float(cfg.cutoff))
    if entries is None:
        return None
    atoms = int(entries.n_atoms.sum())
    if atoms == 0:
        raise InputError("average_num_neighbors needs at least one atom")
    out: dict = {"avg_num_neighbors": int(entries.n_edges.sum()) / atoms}
    if cfg.e0_convention() in ("fit", "average"):
        e0 = S.fit_e0_counts(entries.composition, entries.energy, species)
    else:
        e0 = reference_energies(cfg, species, [], isolated)
    out["e0"] = e0
    if cfg.scale_shift:
        out["shift"] = S.energy_per_atom_counts(entries.composition, entries.energy, e0)["mean"]
        rms = S.force_rms_counts(entries.force_sq, entries.force_count)
        out["scale"] = rms if rms > 1e-8 else 1.0
    return out


def reference_energies(cfg: ModelConfig, species: list[int], structures: list,
                       isolated: dict[int, float] | None = None) -> dict[int, float]:
    """Per-element reference energies ``{Z: eV}`` of ``species`` by ``cfg.e0``.

    ``fit`` and ``average`` (mace-torch's name, whose ``compute_average_E0s`` solves the same
    least squares): :func:`xnn.models.statistics.fit_e0` of ``structures``; ``zero``: 0;
    ``isolated``: the energy labels of the isolated-atom entries (``isolated``, as
    mace-torch's ``load_from_xyz`` takes them), unchanged; a map: its values.

    Raises:
        InputError: ``isolated`` or the map lacks an element of ``species`` (one line naming
            the elements and the alternatives).
    """
    from xnn.models import statistics as S

    convention = cfg.e0_convention()
    if convention in ("fit", "average"):
        return S.fit_e0(structures, species)
    if convention == "zero":
        return {z: 0.0 for z in species}
    if convention == "isolated":
        table = dict(isolated or {})
        missing = sorted(set(species) - set(table))
        if missing:
            raise InputError(f"model.e0=isolated: the training files hold no isolated atom "
                             f"(a one-atom structure with config_type=IsolatedAtom and an "
                             f"energy) of {symbols(missing)}; add one per element, give "
                             "model.e0 as a map {element: eV}, or use model.e0=fit (least "
                             "squares; MACE's average) or zero")
    else:
        table = cfg.e0_table()
        missing = sorted(set(species) - set(table))
        if missing:
            raise InputError(f"model.e0 gives no reference energy of {symbols(missing)}, "
                             f"species of the model ({symbols(species)}); add them to the "
                             "map, or use model.e0=isolated, fit, average or zero")
    return {z: float(table[z]) for z in species}


def residual_structures(cfg: ModelConfig, species: list[int], structures: list) -> list:
    """The structures with the energy and force labels minus the fixed terms' predictions
    (the same structures when every term of the sum is trainable)."""
    from xnn.data import keys as K
    from xnn.models import Potential, Sum

    hp = sum_hyperparameters(cfg, species)
    fixed = []
    for spec in hp["terms"]:
        if not (isinstance(spec, dict) and spec.get("trainable") is False):
            continue
        spec = {k: v for k, v in spec.items() if k != "trainable"}
        term = Sum([spec]).terms[0]
        # a frozen named term with weights has random ones here: only parameter-free terms
        # (d3, lj, ewald, ...) and model files predict anything yet
        if "model_file" in spec or not any(True for _ in term.parameters()):
            fixed.append(term)
    if not fixed:
        return structures
    pot = Potential(Sum(fixed).double())
    out = []
    for g in structures:
        fields = {}
        pred = pot(g.without_edges().to(dtype=torch.float64), forces=K.FORCES in g,
                   stress=False)
        if K.ENERGY in g:
            fields[K.ENERGY] = g[K.ENERGY] - pred[K.ENERGY].to(g[K.ENERGY])
        if K.FORCES in g:
            fields[K.FORCES] = g[K.FORCES] - pred[K.FORCES].to(g[K.FORCES])
        out.append(g.replace(fields))
    return out


def build_model(cfg: TrainConfig, species: list[int], statistics: dict | None) -> nn.Module:
    """Build the configured model (seeded) and apply the statistics; with
    ``committee.size`` K > 1 a :class:`~xnn.models.committee.Committee` of K such models
    (seeds ``committee.seeds``, default ``seed, seed + 1, ...``)."""
    torch.manual_seed(cfg.seed)
    stats = statistics or {}
    key = "term_avg_num_neighbors" if cfg.model.name == "sum" else "avg_num_neighbors"
    hp = model_hyperparameters(cfg.model, species, stats.get(key))
    size = cfg.committee.size
    if size > 1:  # member k: the model a run with seed=seeds[k] builds
        from xnn.models.committee import Committee

        seeds = cfg.committee.seeds or [cfg.seed + k for k in range(size)]
        model = Committee({"name": cfg.model.name, **hp}, size, seeds)
    else:
        model = as_model(build(cfg.model.name, **hp), f"model.name={cfg.model.name}")
    if float(model.cutoff) > float(cfg.model.cutoff) * (1 + 1e-12):
        raise InputError(f"the model's cutoff {float(model.cutoff):g} Å (a sum term's) exceeds "
                         f"model.cutoff {float(cfg.model.cutoff):g}, the cutoff of the data's "
                         f"neighbor lists: set model.cutoff to at least {float(model.cutoff):g}")
    if statistics:
        model.set_statistics(e0=stats.get("e0"), scale=stats.get("scale"),
                             shift=stats.get("shift"))
    return model


def check_native(model: nn.Module, what: str) -> None:
    """Refuse a model xnn cannot save and resume: one with neither registry ``hparams``
    nor a payload of its own (the SevenNet and MACE wrappers store their network as data:
    they are fine-tuned like native models).

    Args:
        what: names the model in the message (``model.name=sevenn``, ``pretrained='f.pt'``).
    Raises:
        InputError: one line naming the model and where to train it.
    """
    from xnn.models.external.mace import MACEWrapper
    from xnn.models.external.sevenn import SevenNetWrapper

    if isinstance(model, (SevenNetWrapper, MACEWrapper)):
        return
    if not isinstance(getattr(model, "hparams", None), dict):
        raise InputError(f"{what} is a {type(model).__name__}; xnn train trains and "
                         "fine-tunes native xnn models and the SevenNet and MACE wrappers "
                         "(pretrained=7net-0 or a mace-torch .model file) only")


def check_trainable(cfg: TrainConfig, model: nn.Module) -> None:
    """Refuse a model xnn cannot train, before anything is trained or written: a wrapper of
    an external model (:func:`check_native`), or a model without trainable parameters
    (``lj``, ``morse``, ``d3``, ``ewald``, a sum whose terms are all ``trainable: false``).

    Raises:
        InputError: one line naming the model and what to train instead.
    """
    what = (f"pretrained={cfg.pretrained!r}" if cfg.pretrained
            else f"model.name={cfg.model.name}")
    check_native(model, what)
    if any(p.requires_grad for p in model.parameters()):
        return
    raise InputError(f"{what} has no trainable parameters: there is nothing to train; choose a "
                     "trainable model (model.name=schnet, painn or equivariant, or a sum with "
                     "a trainable term) or pretrained=FILE of one; to evaluate a fixed model "
                     "on labelled data use xnn eval MODEL DATA")


def _canonical(value):
    """``value`` as JSON would give it back (tuples as lists, int keys as strings)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def check_pretrained_config(cfg: ModelConfig, model: nn.Module, path: str) -> None:
    """Refuse ``model.cutoff`` or ``model.hyperparameters`` that differ from the pretrained
    model's (fine-tuning keeps its architecture; the data's neighbor lists use
    ``model.cutoff``), listing every differing key.

    Raises:
        InputError: one line naming the differing keys and both values.
    """
    hparams = _canonical(getattr(model, "hparams", None) or {})
    diffs = []
    if not math.isclose(float(cfg.cutoff), float(model.cutoff), rel_tol=1e-12):
        diffs.append(f"model.cutoff {float(cfg.cutoff):g} vs {float(model.cutoff):g}")
    for key, value in sorted(cfg.hyperparameters.items()):
        if key not in hparams:
            diffs.append(f"model.hyperparameters.{key} (the pretrained model has none)")
        elif _canonical(value) != hparams[key]:
            diffs.append(f"model.hyperparameters.{key} {_canonical(value)!r} vs "
                         f"{hparams[key]!r}")
    if diffs:
        raise InputError(f"pretrained={path!r}: the config's model section differs from the "
                         f"pretrained model (config vs pretrained: {'; '.join(diffs)}); "
                         "fine-tuning keeps the pretrained architecture: set these to the "
                         f"pretrained values or remove them (model.cutoff defaults to "
                         f"{train_model_default().cutoff:g})")


def multihead_model(model: nn.Module, heads: tuple[list[str], list[str]], splits,
                    what: str) -> tuple[nn.Module, str]:
    """The pretrained ``model`` with the readout heads of a ``finetune.heads`` run, and a
    log line.

    Every head starts as a copy of the pretrained readout (E0s, scale and shift included);
    the heads of new data (not trained by a replay entry) then take the E0s of
    :func:`xnn.training.finetune.new_head_e0` on their structures of the statistics
    sample, the replay heads keep the pretrained ones.

    Args:
        heads: ``(heads, replay heads)`` of :func:`xnn.app.train_replay.run_heads`.
        splits: the run's :class:`~xnn.training.data.DataSplits` (structures marked with
            their head).
        what: names the model in messages (``pretrained='f.pt'``).
    Raises:
        InputError: a model that cannot carry heads (one line).
    """
    from xnn.data import keys as K
    from xnn.models.heads import make_multihead
    from xnn.training.data import structures_for_statistics
    from xnn.training.finetune import new_head_e0

    names, replay = heads
    model = make_multihead(model, names, f"finetune.heads with {what}")
    sample = structures_for_statistics(splits.raw_train)
    graphs = [sample[i] for i in range(len(sample))]
    notes = []
    for index, name in enumerate(names):
        mine = [g for g in graphs if int(g[K.HEAD][0]) == index]
        if name in replay or not mine:
            notes.append(f"{name} (pretrained E0s)")
            continue
        e0 = new_head_e0(model.with_head(name), mine, splits.species)
        model.set_head_statistics(name, e0=e0)
        notes.append(f"{name} (E0s refit on {len(mine)} structures: "
                     + ", ".join(f"{symbols([z])[0]} {v:.4f} eV" for z, v in sorted(e0.items()))
                     + ")")
    return model, "heads: " + "; ".join(notes)

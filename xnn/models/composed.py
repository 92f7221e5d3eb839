"""``Sum``: a potential whose per-atom energies are the sums of its terms' (MLIP + D3 + ...).

One neighbor list at the largest term cutoff is built (by :class:`~xnn.models.Potential`, the
data loader or the domain decomposition); each term gets the edges shorter than its own
cutoff. A term is a model, or a spec (plain data, as in YAML)::

    {"name": "lj", "sigma": 3.4, "epsilon": 0.0104, "cutoff": 8.5}   # built by registry name
    {"name": "d3", "functional": "pbe", "trainable": False}
    {"model_file": "trained.pt"}                      # a file written by xnn.save_model
    {"model_file": "old.pt", "trust": True}           # ... that may unpickle (your own spec)

A spec is the caller's (a config the user wrote, a Python call). Specs read from a file (the
hyperparameters of a saved sum) are data: a ``model_file`` or ``trust`` among them is refused
unless the caller trusted that file (:mod:`xnn.models.trust`).

``trainable: false`` (or ``Sum(terms, trainable=[...])``) freezes a term: its parameters get
``requires_grad=False``, so training fits the other terms on top of it (delta learning).

Saving stores each term's registry name, hyperparameters and trainable flag (``hparams``)
and the weights of all terms (``state_dict``, prefixed ``terms.<k>.``): a term loaded from a
model file is stored by value, not by path. A sum holding an external wrapper without
``hparams`` (mace, sevenn) is saved instead as one model payload per term (each term's own
``to_payload``, plain data) and rebuilt term by term; it has no ``hparams`` (training
checkpoints, which store ``hparams``, refuse it).

A sum with one committee term (e.g. a committee + D3) is itself a committee
(``committee_size`` K, ``member_energies``, ``calibration``): member ``k`` is the committee's
member ``k`` plus the other terms, so every evaluation path gives the committee's spread (the
other terms add none) next to the sum's mean; the other terms are evaluated once per member.

Domain decomposition: ``num_interactions`` is the largest of the terms', ``cutoff`` the largest
cutoff; DD's halo is the declared ``receptive_field``, the largest of the terms' (e.g. D3's
``cutoff + cn_cutoff``, a Coulomb term's ``cutoff`` plus its charge model's receptive field),
and ``receiver_field`` the largest of the terms'. Long-range terms inside a sum are found
by their ``global_sum`` attribute. A ``Sum`` has no sync points of its own (sync-point mode
of a term inside a sum is not wired yet; the halo mode is exact).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.models.base import AtomisticModel, as_model, graph_tracing, squared_lengths

# an edge up to this relative distance beyond a term's cutoff is still handed to the term,
# which ignores it itself (models contribute nothing at or beyond their cutoff): rounding
# of the edge length can never drop an edge the term would count
_MARGIN = 1e-9


def build_term(spec: Mapping[str, Any] | nn.Module) -> tuple[nn.Module, bool | None]:
    """A term and its ``trainable`` flag (``None``: not given) from a model or a spec dict.

    Raises:
        InputError: a spec with neither (or both) ``name`` and ``model_file``.
    """
    if isinstance(spec, nn.Module):
        return spec, None
    if not isinstance(spec, Mapping):
        raise InputError(f"a sum term must be a model or a mapping with `name` or "
                         f"`model_file`, got {type(spec).__name__}")
    hp = dict(spec)
    trainable = hp.pop("trainable", None)
    if trainable is not None and not isinstance(trainable, bool):
        raise InputError(f"sum term {spec!r}: trainable must be true or false")
    if ("name" in hp) == ("model_file" in hp):
        raise InputError(f"sum term {spec!r}: give exactly one of `name` (a registry model "
                         "with its hyperparameters) or `model_file` (a saved model)")
    if "model_file" in hp:
        from xnn.models.serialization import load_model
        from xnn.models.trust import require_reference

        path, trust = hp.pop("model_file"), hp.pop("trust", False)
        if hp:
            raise InputError(f"sum term model_file={path!r}: unknown keys {sorted(hp)} "
                             "(a model file takes only trust and trainable)")
        if not isinstance(trust, bool):
            raise InputError(f"sum term model_file={path!r}: trust must be true or false")
        require_reference(f"model file {path}")  # named by a file's data: the caller decides
        return load_model(path, trust=trust is True), trainable
    from xnn.models.registry import build

    name = hp.pop("name")
    if name == "sum":
        raise InputError("a sum term cannot itself be a sum: list its terms instead")
    return build(name, **hp), trainable


_TERMS_KIND = "xnn-sum-terms"


def _term_from_payload(payload: Mapping[str, Any]) -> nn.Module:
    """One term of a sum saved term by term (as :func:`xnn.load_model` rebuilds a file,
    inside its :func:`~xnn.models.trust.reading`)."""
    from xnn.errors import ModelFileError
    from xnn.models.serialization import model_from_payload

    if not isinstance(payload, Mapping) or not isinstance(payload.get("name"), str):
        raise ModelFileError("a sum term's payload has no model name")
    return model_from_payload(dict(payload))


class Sum(AtomisticModel):
    """Per-atom energies ``E_i = sum_t E_i^(t)`` of several terms, each with its own cutoff.

    Args:
        terms: models or spec dicts (see the module docstring), at least one.
        trainable: one flag per term (default: each spec's ``trainable``, else true); a
            frozen term's parameters have ``requires_grad=False``.

    Attributes:
        terms: ``nn.ModuleList`` of the terms.
        trainable: the flags.
    """

    def __init__(self, terms: Sequence[Mapping[str, Any] | nn.Module],
                 trainable: Sequence[bool] | None = None):
        super().__init__()
        if isinstance(terms, (str, bytes, Mapping)) or not len(terms):
            raise InputError("sum needs a non-empty list of terms")
        built = [build_term(t) for t in terms]
        if trainable is not None and len(trainable) != len(built):
            raise InputError(f"sum: trainable has {len(trainable)} flags for {len(built)} "
                             "terms")
        self.terms = nn.ModuleList([as_model(m, f"sum term {k}")
                                    for k, (m, _) in enumerate(built)])
        self.trainable = [bool(trainable[k]) if trainable is not None else
                          (True if flag is None else flag) for k, (_, flag) in enumerate(built)]
        for m, flag in zip(self.terms, self.trainable):
            if not flag:
                for p in m.parameters():
                    p.requires_grad_(False)
        committees = [k for k, m in enumerate(self.terms) if m.committee_size > 1]
        if len(committees) > 1:
            raise InputError(f"sum terms {committees} are committees: a sum holds at most one "
                             "(its spread is the sum's; the other terms add no spread)")
        self.cutoff = max(float(m.cutoff) for m in self.terms)
        self.num_interactions = max(int(m.num_interactions) for m in self.terms)
        known = [set(m.species) for m in self.terms if m.species is not None]
        self.species = sorted(set.intersection(*known)) if known else None

    @property
    def receptive_field(self) -> float:
        """The largest receptive field of the terms (Å), as each declares it."""
        return max(float(m.receptive_field) for m in self.terms)

    @property
    def receiver_field(self) -> float:
        """The largest ``receiver_field`` of the terms: see
        :class:`~xnn.distributed.DecomposedPotential`."""
        return max(float(m.receiver_field) for m in self.terms)

    @property
    def hparams(self) -> dict:
        """``{"terms": [{"name": ..., **hyperparameters, "trainable": ...}]}`` (plain data,
        rebuilt by ``xnn.models.build("sum", **hparams)``)."""
        from xnn.models.serialization import registry_name

        specs = []
        for m, flag in zip(self.terms, self.trainable):
            hp = m.hparams
            if not isinstance(hp, Mapping):
                raise InputError(f"sum term {type(m).__name__} has no hparams, so this sum "
                                 "has none (it cannot be checkpointed); save it with "
                                 "xnn.save_model, which stores each term's own payload")
            specs.append({"name": registry_name(m), **dict(hp), "trainable": flag})
        return {"terms": specs}

    def to_payload(self) -> dict:
        """What :func:`xnn.save_model` stores: ``hparams`` and ``state_dict`` when every term
        has ``hparams``; else one model payload per term (external wrappers: their own
        ``to_payload``) and the trainable flags."""
        from xnn.models.serialization import model_payload

        if all(isinstance(m.hparams, Mapping) for m in self.terms):
            state = {k: v.detach().cpu() for k, v in self.state_dict().items()}
            return {"hparams": self.hparams, "state_dict": state}
        return {"kind": _TERMS_KIND, "terms": [model_payload(m) for m in self.terms],
                "trainable": list(self.trainable)}

    @classmethod
    def from_payload(cls, payload: dict) -> Sum:
        """Rebuild from :meth:`to_payload` output (data: the caller of
        :func:`xnn.load_model` decides what its terms may load)."""
        from xnn.errors import ModelFileError
        from xnn.models.serialization import _rebuild

        if payload.get("kind") != _TERMS_KIND:
            return _rebuild("sum", payload)
        terms, flags = payload.get("terms"), payload.get("trainable")
        if not isinstance(terms, list) or not isinstance(flags, list) or \
                len(terms) != len(flags):
            raise ModelFileError("sum payload lacks its terms or their trainable flags")
        return cls([_term_from_payload(t) for t in terms], [bool(f) for f in flags])

    @property
    def e0(self) -> dict[int, float] | None:
        """Reference energies of the terms that have them, added (``None``: none has)."""
        tables = [m.e0 for m in self.terms if isinstance(m.e0, Mapping)]
        if not tables:
            return None
        out: dict[int, float] = {}
        for t in tables:
            for z, v in t.items():
                out[int(z)] = out.get(int(z), 0.0) + float(v)
        return out

    def set_statistics(self, e0=None, scale=None, shift=None) -> bool:
        """Data statistics go to the first trainable term that takes them (the MLIP);
        returns whether one did."""
        return any(flag and m.set_statistics(e0=e0, scale=scale, shift=shift)
                   for m, flag in zip(self.terms, self.trainable))

    def check_species(self, numbers: Tensor) -> None:
        for m in self.terms:
            m.check_species(numbers)

    def compile_for_inference(self, enabled: bool = True) -> bool:
        done = [bool(m.compile_for_inference(enabled)) for m in self.terms]
        return any(done)

    def edges_within(self, graph: AtomicGraph, cutoff: float) -> AtomicGraph:
        """``graph`` with only the edges shorter than ``cutoff`` (plus a rounding margin)."""
        if K.EDGE_INDEX not in graph or graph_tracing():
            return graph  # traced: no data-dependent shapes; the term masks by itself
        with torch.no_grad():
            vec = graph.edge_vectors()
            keep = squared_lengths(vec) < (cutoff * (1.0 + _MARGIN)) ** 2
        if bool(keep.all()):
            return graph
        fields = {}
        for key in graph.keys():
            if K.FIELD_SCOPES.get(key) == K.EDGE:
                value = graph[key]
                fields[key] = value[:, keep] if key == K.EDGE_INDEX else value[keep]
        return graph.replace(fields)

    def _term_graph(self, m: nn.Module, graph: AtomicGraph) -> AtomicGraph:
        """``graph`` with the edges term ``m`` weighs (those within its cutoff)."""
        return graph if float(m.cutoff) >= self.cutoff else self.edges_within(graph, m.cutoff)

    def forward(self, graph: AtomicGraph) -> Tensor:
        """Per-atom energies ``[n_atoms]`` (eV), the sum of the terms'."""
        total = None
        for m in self.terms:
            e = m(self._term_graph(m, graph))
            total = e if total is None else total + e.to(total.dtype)
        return total

    # ------------------------------------------------------------------ a committee term
    @property
    def committee_size(self) -> int:
        """K of the sum's committee term (at most one), else 1: a sum with a committee is a
        committee whose member ``k`` is that committee's member ``k`` plus the other terms,
        so its spread is the committee's and its mean the committee's mean plus the rest."""
        return max(int(m.committee_size) for m in self.terms)

    @property
    def calibration(self) -> dict[str, float]:
        """The committee term's calibration factors (see :attr:`committee_size`)."""
        return self.terms[self._committee_index()].calibration

    def _committee_index(self) -> int:
        found = [k for k, m in enumerate(self.terms) if m.committee_size > 1]
        if not found:
            raise InputError("this sum has no committee term")
        return found[0]

    def member_energies(self, graphs: Sequence[AtomicGraph]) -> Tensor:
        """``[K, n_atoms]`` per-atom energies (eV) of member ``k`` on ``graphs[k]``: the
        committee term's member ``k`` plus every other term evaluated on ``graphs[k]`` (the
        other terms run K times, once on each member's positions, so that each member's
        forces and virial include theirs by one backward; they add no spread)."""
        c = self._committee_index()
        total = None
        for k, m in enumerate(self.terms):
            local = [self._term_graph(m, g) for g in graphs]
            e = m.member_energies(local) if k == c else torch.stack([m(g) for g in local])
            total = e if total is None else total + e.to(total.dtype)
        return total

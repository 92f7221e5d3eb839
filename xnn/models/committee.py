"""``Committee``: K models of one kind evaluated together; their mean is the prediction and
their spread the uncertainty.

A committee is built from one model spec and K seeds (member ``k`` is built with
``torch.manual_seed(seeds[k])``, exactly as ``xnn.models.build`` would build it alone after
that seed), or from K models of one class, cutoff and species::

    Committee({"name": "schnet", "species": [29], "cutoff": 4.0}, size=4, seeds=[0, 1, 2, 3])
    Committee([model_a, model_b, model_c])

``forward(graph)`` returns the members' mean per-atom energies, so anything that calls a
model directly runs a committee unchanged. :func:`xnn.models.derivatives.compute_properties`
(the one derivative function) sees ``committee_size > 1`` and returns, besides the means
under the usual keys, every member's results and their spread
(:func:`xnn.models.derivatives.committee_results`): per-system energy, per-atom force and
per-component stress standard deviations, multiplied by the committee's calibration factors
(``calibration``, one per property, default 1; ``xnn train`` fits them on the validation set).

Members are evaluated one after the other (a ``ModuleList`` run in a loop): each gets its own
position and strain leaves, so one backward pass gives every member's forces, bitwise those
of the member evaluated alone (and their double backward in training). Stacking the members'
parameters along a leading axis and ``torch.func.vmap``-ing ``functional_call`` over them
runs SchNet but not the equivariant model (its custom ``autograd.Function`` kernels have no
``setup_context``, which vmap needs), and was slower than the loop on the CPU where it runs
(``docs/committees.md``); the loop runs every model.

Saving stores ``hparams`` = ``{"member": {"name": ..., **hyperparameters}, "size": K, "seeds":
[...], "calibration": {...}}`` and the weights of every member (``members.<k>.``) in one
model file. Members rebuilt from a payload rather than hyperparameters (the MACE and SevenNet
wrappers, whose ``hparams`` is ``None``) are stored as K member payloads instead
(``kind`` :data:`MEMBERS_KIND`, ``members``: each the dict ``xnn.save_model`` writes for that
member alone, tensors and primitives; ``seeds``, ``calibration``); loading rebuilds each
member as its own file would be, under the same trust rules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.models.base import AtomisticModel, as_model

#: ``kind`` of a committee file that holds one payload per member (external wrappers)
MEMBERS_KIND = "xnn-committee-members"

#: the properties with a calibration factor (their standard deviations are multiplied by it)
CALIBRATED = ("energy", "forces", "stress")


def check_calibration(calibration: Mapping[str, float] | None) -> dict[str, float]:
    """``{"energy": c_E, "forces": c_F, "stress": c_S}``, the factors given (missing ones 1).

    Raises:
        InputError: an unknown property, or a factor that is not a finite number > 0.
    """
    out = dict.fromkeys(CALIBRATED, 1.0)
    if calibration is None:
        return out
    if not isinstance(calibration, Mapping):
        raise InputError(f"committee calibration={calibration!r} must be a mapping "
                         f"property -> factor over {list(CALIBRATED)}")
    for key, value in calibration.items():
        if key not in out:
            raise InputError(f"committee calibration has no property {key!r}; choose from "
                             f"{list(CALIBRATED)}")
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and value > 0)
        if not ok:
            raise InputError(f"committee calibration {key}={value!r} must be a finite "
                             "number > 0")
        out[key] = float(value)
    return out


def build_members(member: Mapping[str, Any], seeds: Sequence[int]) -> list[nn.Module]:
    """One model per seed from the spec ``member`` (``{"name": ..., **hyperparameters}``),
    member ``k`` built right after ``torch.manual_seed(seeds[k])``; the caller's random
    state is left as it was."""
    from xnn.models.registry import build

    spec = dict(member)
    name = spec.pop("name", None)
    if not isinstance(name, str):
        raise InputError(f"committee member {member!r} needs a registry `name`")
    if name == "committee":
        raise InputError("a committee member cannot itself be a committee")
    models = []
    for seed in seeds:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            models.append(build(name, **spec))
    return models


def _check_seeds(seeds: Sequence[int] | None, size: int) -> list[int]:
    if seeds is None:
        return list(range(size))
    seeds = [int(s) for s in seeds]
    if len(seeds) != size or len(set(seeds)) != size:
        raise InputError(f"committee seeds={seeds} must be {size} distinct integers (one per "
                         "member)")
    return seeds


class Committee(AtomisticModel):
    """K members of one kind; per-atom energies are the members' mean.

    Args:
        member: a spec ``{"name": <registry name>, **hyperparameters}`` built ``size``
            times, or a sequence of at least two models of one class, cutoff and species.
        size: number of members K (>= 2) built from a spec; ignored for models.
        seeds: one seed per member built from a spec (default ``0 .. K-1``).
        calibration: ``{"energy", "forces", "stress": factor}`` multiplying the standard
            deviations (default 1 each).

    Attributes:
        members: ``nn.ModuleList`` of the K members.
        seeds: the members' seeds (``None`` for a committee made of given models).
        calibration: the factors (see :func:`check_calibration`).
    """

    def __init__(self, member: Mapping[str, Any] | Sequence[nn.Module], size: int = 2,
                 seeds: Sequence[int] | None = None,
                 calibration: Mapping[str, float] | None = None):
        super().__init__()
        if isinstance(member, Mapping):
            if isinstance(size, bool) or not isinstance(size, int) or size < 2:
                raise InputError(f"committee size={size!r} must be an integer >= 2")
            self.seeds: list[int] | None = _check_seeds(seeds, size)
            models = build_members(member, self.seeds)
        else:
            models, self.seeds = list(member), None
        if len(models) < 2:
            raise InputError(f"a committee needs at least 2 members, got {len(models)}")
        nested = [k for k, m in enumerate(models)
                  if as_model(m, f"committee member {k}").committee_size > 1]
        if nested:
            raise InputError(f"committee member(s) {nested} are committees themselves: give "
                             "their members instead")
        self.members = nn.ModuleList([as_model(m, f"committee member {k}")
                                      for k, m in enumerate(models)])
        first = self.members[0]
        for k, m in enumerate(self.members):
            if type(m) is not type(first) or float(m.cutoff) != float(first.cutoff) or \
                    m.species != first.species:
                raise InputError(f"committee member {k} ({type(m).__name__}, cutoff "
                                 f"{m.cutoff}, species {m.species}) differs from member 0 "
                                 f"({type(first).__name__}, cutoff {first.cutoff}, species "
                                 f"{first.species}): members are of one kind")
        self.cutoff = float(first.cutoff)
        self.num_interactions = max(int(m.num_interactions) for m in self.members)
        self.species = first.species
        self.pairs_edges = all(bool(m.pairs_edges) for m in self.members)
        self.traceable = all(bool(m.traceable) for m in self.members)
        self.calibration = check_calibration(calibration)

    # ------------------------------------------------------------------ declared capabilities
    @property
    def committee_size(self) -> int:
        """K, the number of members."""
        return len(self.members)

    @property
    def receptive_field(self) -> float:
        return max(float(m.receptive_field) for m in self.members)

    @property
    def receiver_field(self) -> float:
        return max(float(m.receiver_field) for m in self.members)

    @property
    def sync_points(self) -> list[tuple[str, nn.Module]]:
        """Every member's sync points, named ``members.<k>.<name>`` (member order)."""
        return [(f"members.{k}.{name}", mod) for k, m in enumerate(self.members)
                for name, mod in m.sync_points]

    def set_sync_point(self, name: str, module: nn.Module) -> None:
        """Replace the sync point ``name`` (``members.<k>.sync.<j>``) by ``module``."""
        names = [n for n, _ in self.sync_points]
        if name not in names:
            raise InputError(f"committee has no sync point {name!r}; it has {names}")
        k, inner = name.removeprefix("members.").split(".", 1)
        self.members[int(k)].set_sync_point(inner, module)

    @property
    def e0(self) -> dict[int, float] | None:
        """Member 0's reference energies (``xnn train`` gives every member the same)."""
        return self.members[0].e0

    @property
    def hparams(self) -> dict | None:
        """``{"member": spec, "size": K, "seeds": [...], "calibration": {...}}`` (plain data,
        rebuilt by ``xnn.models.build("committee", **hparams)``); ``None`` for members
        without ``hparams`` (external wrappers, saved member by member: :meth:`to_payload`)."""
        from xnn.models.model_info import registry_name

        hp = self.members[0].hparams
        if hp is None:
            return None
        if not isinstance(hp, Mapping):
            raise InputError(f"committee member {type(self.members[0]).__name__} has no "
                             "hparams: this committee cannot be saved")
        return {"member": {"name": registry_name(self.members[0]), **dict(hp)},
                "size": self.committee_size, "seeds": self.seeds,
                "calibration": dict(self.calibration)}

    @property
    def stores_members(self) -> bool:
        """Saved as K member payloads (members without ``hparams``: external wrappers)."""
        return self.members[0].hparams is None

    def to_payload(self) -> dict:
        """What ``xnn.save_model`` writes: ``hparams`` and one state dict, or for members
        without ``hparams`` (:attr:`stores_members`) the members' own payloads, the
        seeds and the calibration."""
        from xnn.models.serialization import model_payload

        if not self.stores_members:
            state = {k: v.detach().cpu() for k, v in self.state_dict().items()}
            return {"hparams": self.hparams, "state_dict": state}
        return {"kind": MEMBERS_KIND, "members": [model_payload(m) for m in self.members],
                "seeds": self.seeds, "calibration": dict(self.calibration)}

    @classmethod
    def from_payload(cls, payload: dict) -> Committee:
        """Rebuild from :meth:`to_payload` output, read as data: the member payloads are
        rebuilt by :func:`xnn.models.serialization.model_from_payload` inside the caller's
        trust (a member that would unpickle needs ``load_model(..., trust=True)``)."""
        from xnn.errors import ModelFileError
        from xnn.models.serialization import _rebuild, model_from_payload

        if payload.get("kind") != MEMBERS_KIND:
            return _rebuild("committee", payload)
        members, seeds = payload.get("members"), payload.get("seeds")
        if not isinstance(members, list) or not all(isinstance(m, dict) for m in members):
            raise ModelFileError("committee payload lacks its members' payloads")
        model = cls([model_from_payload(m) for m in members],
                    calibration=payload.get("calibration"))
        model.seeds = None if seeds is None else _check_seeds(seeds, len(members))
        return model

    def set_calibration(self, calibration: Mapping[str, float]) -> None:
        """Replace the factors given (others keep theirs); see :func:`check_calibration`."""
        self.calibration = check_calibration({**self.calibration, **dict(calibration)})

    def set_statistics(self, e0: dict[int, float] | None = None, scale: float | None = None,
                       shift: float | None = None) -> bool:
        """Give every member the same statistics; whether they took them."""
        took = [m.set_statistics(e0=e0, scale=scale, shift=shift) for m in self.members]
        return any(took)

    def compile_for_inference(self, enabled: bool = True) -> bool:
        took = [m.compile_for_inference(enabled) for m in self.members]
        return any(took)

    # ------------------------------------------------------------------ evaluation
    def member_energies(self, graphs: Sequence[AtomicGraph]) -> Tensor:
        """``[K, n_atoms]`` per-atom energies (eV) of member ``k`` on ``graphs[k]`` (the same
        atoms and edges; each its own positions to differentiate against)."""
        if len(graphs) != len(self.members):
            raise InputError(f"committee of {len(self.members)} members given "
                             f"{len(graphs)} graphs")
        return torch.stack([m(g) for m, g in zip(self.members, graphs)])

    def forward(self, graph: AtomicGraph) -> Tensor:
        """``[n_atoms]`` the members' mean per-atom energies (eV)."""
        return self.member_energies([graph] * len(self.members)).mean(0)

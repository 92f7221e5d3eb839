"""The LAMMPS ML-IAP unified route (``pair_style mliap unified FILE 0``) without LAMMPS:
:class:`~xnn.interop.mliap.XnnMLIAPUnified` on 1, 2 and 3 emulated LAMMPS ranks
(:mod:`xnn.testing.mliap`: owned atoms, ghosts of one cutoff, LAMMPS's pair list, forward and
reverse exchanges across the ranks in lock-step) gives the one-process energy, per-atom
energies, forces assembled from pair forces and the virial ``-Σ rij ⊗ fij`` to 1e-10 (fp64),
for every native model with sync points (mode ``sync``) on a triclinic cell and a cluster, and
for one-hop models without sync points (mode ``halo``); the file ``xnn export --format
lammps-mliap`` writes round-trips; what the route cannot run is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import structures as S
from helpers.models import SMALL, lj

from xnn.cli.main import main as cli
from xnn.data import keys as K
from xnn.errors import InputError
from xnn.interop.mliap import XnnMLIAPUnified, export_mliap
from xnn.models import build
from xnn.models.serialization import save_model
from xnn.testing.mliap import (
    FakeMLIAPData,
    assemble,
    check_mliap,
    emulate_ranks,
    fake_data,
    run_ranks,
)

SYNC_MODELS = ["schnet", "painn", "equivariant"]
ELEMENTS = ["Cu", "O"]  # LAMMPS types 1, 2: not the model's species order [8, 29]


def two_species(name: str, layers: int = 2):
    """A small fp64 Cu/O network with perturbed weights (non-trivial outputs)."""
    torch.manual_seed(1)
    model = build(name, species=[8, 29], cutoff=3.0, num_interactions=layers,
                  **SMALL[name]).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def with_oxygen(graph):
    """Every third atom of ``graph`` becomes O."""
    numbers = graph.numbers.clone()
    numbers[::3] = 8
    return graph.replace({K.NUMBERS: numbers})


SYSTEMS = {"triclinic": lambda: with_oxygen(S.triclinic()),
           "cluster": lambda: with_oxygen(S.cluster())}
MODELS = {name: two_species(name) for name in SYNC_MODELS}


@pytest.mark.parametrize("system", list(SYSTEMS))
@pytest.mark.parametrize("name", SYNC_MODELS)
def test_sync_mode_equals_one_process(name, system):
    unified = XnnMLIAPUnified(MODELS[name], ELEMENTS)
    assert unified.mode == "sync" and unified.rcutfac == 1.5
    graph = SYSTEMS[system]()
    for n_ranks in (1, 2, 3):
        check_mliap(unified, graph, n_ranks, tol=1e-10)


def _run(unified, graph, n_ranks, data_cls=FakeMLIAPData):
    cutoff = 2.0 * unified.rcutfac
    parts = emulate_ranks(graph, n_ranks, cutoff, cutoff)
    datas = fake_data(parts, graph.numbers.numpy(), list(unified.element_types))
    datas = [data_cls(d.part, d.elems, d.world) for d in datas]
    run_ranks(unified, datas)
    return parts, datas, assemble(datas, graph.n_atoms)


class OwnRowsOnly(FakeMLIAPData):
    """An exchange that leaves ghost rows as the rank computed them (no owner rows)."""

    def forward_exchange(self, src, dst, vec_len):
        self.exchanges += 1
        dst.copy_(src)

    def reverse_exchange(self, src, dst, vec_len):
        self.exchanges += 1
        dst.copy_(src)


def test_emulated_ranks_exchange_across_ranks_and_the_exchange_matters():
    """Three real ranks: each holds ghosts owned by the others and meets them in every
    exchange (one per sync point forward, one backward); without the owners' rows the
    forces are wrong, so the comparison above can fail."""
    model = MODELS["schnet"]
    unified = XnnMLIAPUnified(model, ELEMENTS)
    graph = SYSTEMS["triclinic"]()
    parts, datas, got = _run(unified, graph, 3)
    n_sync = len(model.sync_points)
    for p, d in zip(parts, datas):
        others = set(p.owner_rank[p.nlocal:].tolist()) - {p.rank}
        assert p.nlocal > 0 and others, "every rank holds atoms and ghosts of other ranks"
        assert (p.pair_i < p.nlocal).all()  # LAMMPS's list: owned receivers only
        assert d.exchanges == 2 * n_sync
    assert sorted(i for p in parts for i in p.global_index[: p.nlocal]) == list(
        range(graph.n_atoms))
    _, _, wrong = _run(unified, graph, 3, OwnRowsOnly)
    err = (wrong["forces"] - got["forces"]).abs().max() / got["forces"].abs().max()
    assert err > 1e-3


@pytest.mark.parametrize("system", list(SYSTEMS))
def test_halo_mode_one_hop_models_equal_one_process(system):
    """Models without sync points, one hop: LAMMPS's own list (owned receivers, FILE 0)."""
    graph = SYSTEMS[system]()
    one_layer = two_species("schnet", layers=1)
    morse = build("morse", D=0.3, alpha=1.3, r0=2.5, cutoff=4.0).double()
    for model in (lj(cutoff=4.0).double(), morse, one_layer):
        unified = XnnMLIAPUnified(model, ELEMENTS)
        assert unified.mode == "halo" and not unified.ghost_neighbors
        assert unified.ghost_cutoff == float(model.cutoff)
        for n_ranks in (1, 2, 3):
            check_mliap(unified, graph, n_ranks, tol=1e-10)


@pytest.mark.parametrize("name", ["schnet", "painn"])
def test_halo_mode_multi_hop_with_ghost_neighbours_equals_one_process(name):
    """A two-layer model without exchanges: ghosts of the whole receptive field, each a
    receiver too (``pair_style mliap unified FILE 1``); with LAMMPS's owned receivers only
    (FILE 0) it is refused at the first evaluation, not silently wrong."""
    unified = XnnMLIAPUnified(MODELS[name], ELEMENTS, mode="halo")
    assert unified.ghost_neighbors and unified.ghost_cutoff == 6.0
    assert unified.lammps_lines("m.pt")[0] == "pair_style mliap unified m.pt 1"
    assert unified.lammps_lines("m.pt")[2].startswith("comm_modify cutoff 8")
    graph = SYSTEMS["triclinic"]()
    for n_ranks in (1, 3):
        check_mliap(unified, graph, n_ranks, tol=1e-10)
    parts = emulate_ranks(graph, 2, 6.0, 3.0)  # owned receivers only
    datas = fake_data(parts, graph.numbers.numpy(), ELEMENTS)
    with pytest.raises(InputError, match="pair_style mliap unified FILE 1"):
        run_ranks(unified, datas)


@pytest.mark.parametrize("system", list(SYSTEMS))
@pytest.mark.parametrize("name", [*SYNC_MODELS, "lj"])
def test_a_subset_of_types_under_hybrid_overlay_is_that_subsets_model(name, system):
    """``pair_style hybrid/overlay ... mliap unified FILE 0`` with ``pair_coeff * * mliap Cu
    NULL``: LAMMPS lists only the Cu atoms as i-atoms (``nlistatoms < nlocal``, ``iatoms``
    with gaps), pairs join Cu atoms only, O atoms have ``elems`` -1. Energy, per-atom
    energies (``eatoms[ii]`` of atom ``iatoms[ii]``), forces and virial are the model's on
    the Cu atoms alone (zero on O), on 1, 2 and 3 emulated ranks, to 1e-10."""
    model = lj(cutoff=3.0).double() if name == "lj" else MODELS[name]
    unified = XnnMLIAPUnified(model, ELEMENTS)
    graph = SYSTEMS[system]()
    for n_ranks in (1, 2, 3):
        check_mliap(unified, graph, n_ranks, tol=1e-10, null_numbers=(8,))


def test_subset_lists_are_lammps_hybrid_lists():
    """The emulated hybrid lists are what the test above needs: per rank a strict subset of
    the owned atoms with gaps (``eatoms[ii]`` is not atom ``ii``'s), ``eatoms`` of
    ``nlistatoms`` rows, pairs between listed atoms only, ``elems`` -1 for the O atoms."""
    graph = SYSTEMS["triclinic"]()
    cu = (graph.numbers == 29).numpy()
    parts = emulate_ranks(graph, 2, 3.0, 3.0, listed=cu)
    datas = fake_data(parts, graph.numbers.numpy(), ELEMENTS, null_numbers=(8,))
    for p, d in zip(parts, datas):
        assert 0 < p.nlistatoms < p.nlocal and d.eatoms.shape == (p.nlistatoms,)
        assert (p.iatoms[: p.nlistatoms] != np.arange(p.nlistatoms)).any()
        assert cu[p.global_index[p.pair_i]].all() and cu[p.global_index[p.pair_j]].all()
        assert (d.elems[~cu[p.global_index]] == -1).all() and (d.ielems >= 0).all()


def test_exported_file_round_trips(tmp_path, capsys):
    """``xnn export --format lammps-mliap`` writes what ``torch.load`` (LAMMPS) reads back:
    the same object, the same numbers on emulated ranks; float32 too."""
    model = MODELS["painn"]
    save_model(model, tmp_path / "model.pt")
    out = tmp_path / "cuo.pt"
    assert cli(["export", str(tmp_path / "model.pt"), "--format", "lammps-mliap",
                "--elements", *ELEMENTS, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"pair_style mliap unified {out} 0; pair_coeff * * Cu O" in printed
    loaded = torch.load(out, weights_only=False)
    assert isinstance(loaded, XnnMLIAPUnified)
    assert loaded.element_types == ELEMENTS and loaded.rcutfac == 0.5 * float(model.cutoff)
    assert (loaded.ndescriptors, loaded.nparams, loaded.interface) == (1, 1, None)
    graph = SYSTEMS["triclinic"]()
    _, _, want = _run(XnnMLIAPUnified(model, ELEMENTS), graph, 2)
    _, _, got = _run(loaded, graph, 2)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=1e-12)
    check_mliap(loaded, graph, 3, tol=1e-10)
    # default element list: the model's species in order; float32
    assert cli(["export", str(tmp_path / "model.pt"), "--format", "lammps-mliap",
                "--dtype", "float32"]) == 0
    f32 = torch.load(tmp_path / "model.lammps-mliap.pt", weights_only=False)
    assert f32.element_types == ["O", "Cu"] and f32.dtype == torch.float32
    check_mliap(f32, graph, 2, tol=1e-4)


def _one_line(call) -> str:
    with pytest.raises(InputError) as err:
        call()
    msg = str(err.value)
    assert "\n" not in msg and msg
    return msg


def test_refusals_are_one_line(tmp_path, capsys):
    deep = MODELS["schnet"]
    assert "no sync points" in _one_line(lambda: XnnMLIAPUnified(lj().double(), ["Cu"], "sync"))
    assert "does not apply" in _one_line(lambda: XnnMLIAPUnified(deep, ELEMENTS, "graph"))
    assert "does not apply" in _one_line(lambda: XnnMLIAPUnified(deep, ELEMENTS, "auto"))
    assert "mode must be one of" in _one_line(lambda: XnnMLIAPUnified(deep, ELEMENTS, "x"))
    ewald = build("ewald", cutoff=5.0)
    assert "long-range" in _one_line(lambda: XnnMLIAPUnified(ewald, ["Cu"]))
    assert "any element" in _one_line(lambda: XnnMLIAPUnified(lj().double()))
    assert "Xx" in _one_line(lambda: XnnMLIAPUnified(deep, ["Cu", "Xx"]))
    assert "unknown to the model" in _one_line(lambda: XnnMLIAPUnified(deep, ["Cu", "Au"]))
    assert "torch device" in _one_line(lambda: XnnMLIAPUnified(deep, ELEMENTS, device="gpu0"))
    assert ".pt" in _one_line(lambda: export_mliap(deep, tmp_path / "x.pkl", ELEMENTS))
    save_model(deep, tmp_path / "model.pt")
    assert cli(["export", str(tmp_path / "model.pt"), "--format", "torchscript",
                "--elements", "Cu"]) != 0
    err = capsys.readouterr().err.strip()
    assert "options of --format lammps-mliap" in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]  # nothing written


def test_mace_wrapper_runs_the_route():
    """The mace-torch wrapper through the same object: with sync points (mode sync) where
    it has them, else with ghost neighbours (mode halo); equal to one process either way."""
    pytest.importorskip("mace")
    from helpers.models import small_mace

    model = small_mace()
    unified = XnnMLIAPUnified(model, ["Cu"])
    assert unified.mode == ("sync" if model.sync_points else "halo")
    graph = SYSTEMS["triclinic"]()
    graph = graph.replace({K.NUMBERS: torch.full_like(graph.numbers, 29)})
    check_mliap(unified, graph, 2, tol=1e-10)


class NullWhenEmpty(FakeMLIAPData):
    """LAMMPS hands over ``None`` for the pair arrays of a rank without pairs."""

    @property
    def rij(self):
        return self.part.rij if self.npairs else None

    @property
    def pair_i(self):
        return self.part.pair_i if self.npairs else None

    @property
    def pair_j(self):
        return self.part.pair_j if self.npairs else None


def test_ranks_without_pairs_still_exchange():
    """Two far atoms on two ranks: no pairs, no ghosts, every exchange still called on both
    ranks (collective), energies are the isolated atoms' (the model's e0 table)."""
    from xnn.data import AtomicGraph
    from xnn.models.derivatives import compute_properties
    from xnn.neighbors import with_edges

    graph = AtomicGraph.from_arrays(torch.tensor([[0.0, 0.0, 0.0], [9.0, 0.0, 0.0]]),
                                    torch.tensor([29, 8]), dtype=torch.float64)
    model = MODELS["painn"]
    unified = XnnMLIAPUnified(model, ELEMENTS)
    parts, datas, got = _run(unified, graph, 2, NullWhenEmpty)
    assert [(p.nlocal, p.ntotal, len(p.pair_i)) for p in parts] == [(1, 1, 0), (1, 1, 0)]
    assert [d.exchanges for d in datas] == [2 * len(model.sync_points)] * 2
    ref = compute_properties(model, with_edges(graph, 3.0, backend="brute"))
    torch.testing.assert_close(got["energies"], ref["energies"], rtol=1e-12, atol=1e-12)
    assert got["forces"].abs().max() == 0 and got["virial"].abs().max() == 0


def _decomposed_worker(rank, world_size, cases):
    """xnn's own decomposition (mode sync, gloo) of every case; results sorted by atom id."""
    from xnn.data import AtomicGraph
    from xnn.distributed import DistributedManager
    from xnn.testing.decomposition import decomposed

    torch.set_default_dtype(torch.float64)
    manager = DistributedManager.initialize(backend="gloo", timeout_s=60)
    out = {}
    for name, model, fields in cases:
        graph = AtomicGraph(fields) if rank == 0 else None
        result = decomposed(model, manager, "sync", graph).single_point(graph)
        out[name] = {k: v.detach().cpu() for k, v in result.items()}
    return out


def test_equals_xnns_own_decomposition():
    """The emulated LAMMPS ranks (3) against xnn's decomposed evaluation in mode sync on 2
    gloo ranks, by atom id: energy, per-atom energies, forces and virial to 1e-10."""
    from dist_helpers import spawn

    graph = SYSTEMS["triclinic"]()
    cases = [(name, MODELS[name], graph.without_edges().fields) for name in SYNC_MODELS]
    reference = spawn(_decomposed_worker, 2, args=(cases,), timeout_s=300)[0]
    order = torch.argsort(graph.atom_id)
    for name in SYNC_MODELS:
        _, _, got = _run(XnnMLIAPUnified(MODELS[name], ELEMENTS), graph, 3)
        ref = reference[name]
        assert torch.equal(ref[K.ATOM_ID], graph.atom_id[order])
        for key, mine in (("energy", got["energy"]), ("energies", got["energies"][order]),
                          ("forces", got["forces"][order]), ("virial", got["virial"])):
            want = ref[key].reshape(mine.shape)
            err = float((mine - want).abs().max() / want.abs().max())
            assert err <= 1e-10, (name, key, err)


def test_cli_modes_are_the_routes_modes():
    """``xnn export --mode`` offers exactly the modes the route takes (one vocabulary)."""
    from xnn.cli.main import build_parser
    from xnn.distributed.modes import MODES
    from xnn.interop.mliap import MLIAP_MODES

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    export = sub.choices["export"]
    mode = next(a for a in export._actions if a.dest == "mode")
    assert list(mode.choices) == list(MLIAP_MODES) and set(MLIAP_MODES) <= set(MODES)


def test_the_callers_model_is_left_alone():
    model = two_species("schnet")
    before = [(p.requires_grad, p.clone()) for p in model.parameters()]
    model.train()
    unified = XnnMLIAPUnified(model, ELEMENTS)
    check_mliap(unified, SYSTEMS["cluster"](), 2)
    assert model.training and [p.requires_grad for p in model.parameters()] == [
        g for g, _ in before]
    assert all(torch.equal(p, q) for p, (_, q) in zip(model.parameters(), before))
    assert unified.model is not model and not unified.model.training

"""The MACE wrapper's sync points: identities in one process, halo feature exchanges under
domain decomposition (mode "sync": a ghost shell of one cutoff + skin instead of two).

Random-weight mace-torch models (2 interactions, 8 channels, fp64) built here; gloo ranks on
CPU; decomposed energy, per-atom energies, forces (by global atom id) and stress (virial for
the cluster) equal one process to 1e-10 relative. One set of ranks per world size (2, 3) runs
every case of this module for it (3 ranks, under ``-m slow``: the ScaleShiftMACE cases).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from dist_helpers import spawn
from helpers import mace_model, molecule, triclinic

from xnn.data.graph import AtomicGraph
from xnn.models.external._optional import MissingExtraError, import_extra

try:
    import_extra("mace", "mace.modules")
except MissingExtraError as _err:
    pytest.skip(str(_err), allow_module_level=True)

TOL = 1e-10
SKIN = 0.3
CUTOFF = 3.2  # r_max of helpers.mace_model


def _si_cu(graph: AtomicGraph) -> AtomicGraph:
    """``graph`` (Cu) with every third atom by id made Si (the same atoms on every rank)."""
    numbers = torch.where(graph.atom_id % 3 == 0, 14, graph.numbers)
    return graph.replace(numbers=numbers)


def wrapper(cls: str = "ScaleShiftMACE", block: str | None = None, backend: str = "reference",
            pair_repulsion: bool = False):
    """The xnn wrapper of a random-weight Si/Cu MACE (``block``: both interactions' class,
    with ZBL pair repulsion if asked; ``backend="cueq"``: evaluated through mace-torch's
    cuEquivariance copy)."""
    from xnn.models import build

    if block is None:
        return build("mace", model=mace_model(cls=cls), backend=backend).eval()
    import numpy as np
    from e3nn import o3

    (mace_modules,) = import_extra("mace", "mace.modules")
    torch.manual_seed(1)
    cls_ = mace_modules.interaction_classes[block]
    model = mace_modules.ScaleShiftMACE(
        atomic_inter_scale=1.3, atomic_inter_shift=0.2, r_max=CUTOFF, num_bessel=6,
        num_polynomial_cutoff=5, max_ell=2, interaction_cls=cls_, interaction_cls_first=cls_,
        num_interactions=2, num_elements=2, hidden_irreps=o3.Irreps("8x0e + 8x1o"),
        MLP_irreps=o3.Irreps("8x0e"), gate=torch.nn.functional.silu,
        atomic_energies=np.array([-1.5, -3.25]), avg_num_neighbors=8.0,
        atomic_numbers=[14, 29], correlation=2, pair_repulsion=pair_repulsion)
    return build("mace", model=model.double().eval()).eval()


#: the interaction block classes of mace-torch other than the default (residual) one
BLOCKS = ("RealAgnosticInteractionBlock", "RealAgnosticDensityInteractionBlock",
          "RealAgnosticAttResidualInteractionBlock",
          "RealAgnosticResidualNonLinearInteractionBlock")
#: models, and structures: a triclinic periodic cell (72 atoms) and a cluster (32 atoms)
MODELS = {"scaleshift": lambda: wrapper(),
          "cueq": lambda: wrapper(backend="cueq"),
          "so3": lambda: wrapper("MACE"),
          "density-zbl": lambda: wrapper(block="RealAgnosticDensityResidualInteractionBlock",
                                         pair_repulsion=True),
          **{b: partial(wrapper, block=b) for b in BLOCKS}}
STRUCTURES = {"triclinic": lambda: _si_cu(triclinic()), "cluster": lambda: _si_cu(molecule())}
ALL = ("halo", "sync", "graph")
#: (model, structure, modes); 3 ranks run the first two (the variants cost a spawn's time)
CASES = [("scaleshift", "triclinic", ALL), ("scaleshift", "cluster", ALL),
         ("so3", "cluster", ALL), ("density-zbl", "triclinic", ALL),
         ("cueq", "triclinic", ("sync",))] + [(b, "triclinic", ("sync",)) for b in BLOCKS]


def cases(world: int) -> list[tuple]:
    return CASES if world == 2 else CASES[:2]


def worker(rank, world):
    from xnn.distributed import DistributedManager, parallelize
    from xnn.models import Potential
    from xnn.testing import compare_by_id

    torch.set_default_dtype(torch.float64)
    manager = DistributedManager.initialize(backend="gloo", timeout_s=60)
    results = {}
    for model_name, struct, modes in cases(world):
        model, graph = MODELS[model_name](), STRUCTURES[struct]()
        ref = Potential(model, skin=SKIN)(graph) if rank == 0 else None
        for mode in modes:
            dd = parallelize(model, manager, mode, skin=SKIN)
            out = dd.single_point(graph if rank == 0 else None)
            entry = {"stats": dd.stats(), "mode": dd.mode,
                     "sync": [type(m).__name__ for _, m in model.sync_points]}
            if rank == 0:
                entry["errors"] = compare_by_id(out, ref, graph)
                entry["force_scale"] = float(ref["forces"].abs().max())
            results[f"{model_name}-{struct}-{mode}"] = entry
    return results


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)])
def ranks(request):
    """Every case of this module on ``world`` gloo ranks (one spawn per world size; 3 ranks,
    a repeat of the 2-rank ScaleShiftMACE cases, under -m slow)."""
    return request.param, spawn(worker, request.param, timeout_s=400)


def test_sync_points_declared_and_identities_in_one_process():
    """One sync point between the two interactions; in one process the wrapper gives
    mace-torch's own per-atom energies bitwise, and the sync point sees (and its output
    replaces) the node features interaction 1 reads, ``[n_atoms, 8 x (1 + 3)]``."""
    from xnn.distributed.modes import spatial_mode
    from xnn.neighbors import with_edges

    model = wrapper()
    assert [n for n, _ in model.sync_points] == ["sync.0"] and spatial_mode(model) == "sync"
    graph = with_edges(STRUCTURES["triclinic"](), CUTOFF + SKIN)
    expected = model.model(model.mace_inputs(graph), training=False,
                           compute_force=False)["node_energy"]
    assert torch.equal(model(graph), expected)
    seen = []

    class Spy(torch.nn.Module):  # records what the sync point receives, then perturbs it
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def forward(self, features, graph):
            seen.append(tuple(features.shape))
            return features * self.scale

    model.set_sync_point("sync.0", Spy(1.0))
    assert torch.equal(model(graph), expected)
    assert seen == [(graph.n_atoms, 32)]  # 8x0e + 8x1o
    model.set_sync_point("sync.0", Spy(0.5))  # what the sync point returns is what is read
    assert not torch.allclose(model(graph), expected)
    for block in model.model.interactions:  # the hooks live for the call only
        assert not block._forward_pre_hooks


def test_sync_mode_equals_one_process(ranks):
    """Modes sync and graph (now that the wrapper has sync points) and halo, on a triclinic
    periodic cell and a cluster, ScaleShiftMACE and MACE, residual and density-normalised
    interaction blocks with ZBL repulsion; mode sync also for every other interaction block
    class of mace-torch and the cuEquivariance copy: decomposed = one process to 1e-10."""
    world, res = ranks
    for case, entry in res[0].items():
        errors = dict(entry["errors"])
        assert errors.pop("ids"), case
        assert entry["force_scale"] > 0.01, case  # rattled: forces are not trivially zero
        assert max(errors.values()) <= TOL, (world, case, errors)
        assert entry["mode"] == case.rsplit("-", 1)[1]
    for r in res:  # the identities are back after every call
        assert all(e["sync"] == ["SyncPoint"] for e in r.values())


def test_sync_mode_holds_one_cutoff_of_ghosts(ranks):
    """In mode sync every rank holds a ghost shell of cutoff + skin (halo: 2 x cutoff + skin)
    and fewer ghosts than in mode halo; the periodic cell is genuinely split."""
    world, res = ranks
    assert len(res[0]) == sum(len(modes) for *_, modes in cases(world))
    for model_name, struct, modes in cases(world):
        if "halo" not in modes:
            continue
        for r in res:
            sync = r[f"{model_name}-{struct}-sync"]["stats"]
            halo = r[f"{model_name}-{struct}-halo"]["stats"]
            assert sync["halo_width"] == pytest.approx(CUTOFF + SKIN)
            assert halo["halo_width"] == pytest.approx(2 * CUTOFF + SKIN)
            assert sync["n_owned"] == halo["n_owned"]
            if struct == "triclinic":
                assert 0 < sync["n_ghost"] < halo["n_ghost"], (world, r)
            else:
                assert sync["n_ghost"] <= halo["n_ghost"], (world, r)
    owned = [r["scaleshift-triclinic-sync"]["stats"]["n_owned"] for r in res]
    assert sum(owned) == 72 and all(n > 0 for n in owned)


def test_compiled_copy_gives_way_to_exchanges():
    """``compile_for_inference``: the torch.compile copy is one region that cannot hold an
    exchange, so while a sync point is not the identity the eager model runs (the copy is
    not even made) and the sync point is applied."""
    from xnn.neighbors import with_edges

    graph = with_edges(STRUCTURES["cluster"](), CUTOFF)
    eager, compiled = wrapper().eval(), wrapper().eval()
    assert compiled.compile_for_inference(True)

    class Half(torch.nn.Module):
        def forward(self, features, graph):
            return 0.5 * features

    for model in (eager, compiled):
        model.set_sync_point("sync.0", Half())
    assert torch.equal(compiled(graph), eager(graph))
    assert compiled._compiled is None



def test_auto_may_choose_sync():
    """Mode auto's cost model (rank 0, no ranks needed) weighs sync for MACE now (before:
    halo, the wrapper had no sync points): a 2048-atom cell on 4 ranks takes sync with a
    halo of one cutoff + skin, and no case falls back to halo."""
    from helpers import fcc, graph

    from xnn.distributed.graph.auto import choose_mode

    model = wrapper()
    small = choose_mode(model, STRUCTURES["triclinic"](), 4, skin=SKIN)
    large = choose_mode(model, _si_cu(graph(fcc((8, 8, 8)))), 4, skin=SKIN)
    assert small[0] in ("sync", "graph"), small
    assert large[0] == "sync" and f"{CUTOFF + SKIN:.3g} Å halo" in large[1], large


def test_auto_weighs_the_feature_width_mace_exchanges():
    """The wrapper declares the width of the node features its sync point passes (here
    ``8x0e + 8x1o``: 32 numbers per atom, not the 64 mode auto assumed for a model without
    hyperparameters): a recording sync point sees exactly that width per atom, and auto's
    estimate (rank 0, no ranks needed) weighs it: the halo and graph costs it reports are
    the cost model's with 32 features (3 + (L - 1) 32 numbers per exchanged row)."""
    import re

    from helpers import fcc, graph

    from xnn.distributed.graph.auto import GAMMA, LATENCY, choose_mode, halo_counts
    from xnn.models import Potential
    from xnn.models.base import SyncPoint

    model = wrapper()
    widths = []

    class Recording(SyncPoint):
        def forward(self, features, graph):
            widths.append(features[0].numel())
            return features

    model.set_sync_point("sync.0", Recording())
    Potential(model)(STRUCTURES["triclinic"]())
    assert widths == [32] and model.sync_width == 32 and model.num_interactions == 2
    model.set_sync_point("sync.0", SyncPoint())
    big = _si_cu(graph(fcc((8, 8, 8))))
    mode, reason = choose_mode(model, big, 4, skin=SKIN)
    assert "32 features" in reason, reason
    halo, graph_cost = map(float, re.search(r"halo ([\d.e+]+) vs graph ([\d.e+]+)",
                                            reason).groups())
    c = halo_counts(big, 4, CUTOFF + SKIN)
    worst = max(range(4), key=lambda r: c["owned"][r] + c["ghost"][r])
    n_own, rows = max(c["owned"]), 3 + 32
    want_halo = 2 * n_own + GAMMA * rows * c["ghost"][worst] + LATENCY * 3 * 2
    want_graph = 2 * n_own + GAMMA * rows * (big.n_atoms - min(c["owned"])) + LATENCY * 2 * 2
    assert halo == pytest.approx(want_halo, rel=1e-3)
    assert graph_cost == pytest.approx(want_graph, rel=1e-3)
    assert mode == ("graph" if want_graph < want_halo else "sync")


def test_torchscript_module_has_no_sync_points():
    """A TorchScript-compiled mace-torch module runs no Python hooks: wrapped, it declares
    no sync points (decomposed: mode halo, as before) and gives the eager module's numbers."""
    from e3nn.util import jit

    from xnn.distributed.modes import spatial_mode
    from xnn.models import Potential, build

    module = mace_model()
    scripted = build("mace", model=jit.compile(mace_model()))
    assert scripted.sync_points == [] and spatial_mode(scripted) == "halo"
    graph = STRUCTURES["cluster"]()
    ref, out = Potential(build("mace", model=module))(graph), Potential(scripted)(graph)
    for key in ("energy", "forces"):
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-10)

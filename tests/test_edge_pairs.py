"""Reverse-edge pairs (xnn.neighbors.pairs) and the compiled MD step on a paired list: every
edge's reverse found (bitwise the negated vector), lists that are not full refused, the
cutoff filter keeping pairs together, and a model that weighs each pair once (an EAM-like
density, wrong on a wrong pairing) following the eager trajectory; MACE's radial networks
once per pair (cuEquivariance copy, every convolution path) and xnn's equivariant model's
(reference kernels, also in the compiled step) equal to per edge."""

from __future__ import annotations

import pytest
import torch
from helpers.compiled import MD_SKIN as SKIN
from helpers.compiled import argon_system as _system
from helpers.kernels import SPECIES, requires_cue
from helpers.kernels import pair_equivariant as _equivariant
from helpers.kernels import paired as _paired
from helpers.kernels import tiny_mace as _tiny_mace

from xnn.data import keys as K
from xnn.dynamics import maxwell_boltzmann, nve
from xnn.dynamics.compiled import CompiledVerlet, within_cutoff, within_cutoff_paired
from xnn.models import Potential, build, compute_properties
from xnn.models.base import AtomisticModel, edges_paired, pairing_edges
from xnn.neighbors import with_edges
from xnn.neighbors.pairs import pair_order
from xnn.testing import random_periodic_system


@pytest.mark.parametrize("volume,cutoff", [(11.0, 3.5), (6.0, 4.0)])  # (6, 4): self-images
def test_pair_order_reverses_every_edge(volume, cutoff):
    g = random_periodic_system(SPECIES, 6, volume_per_atom=volume, min_distance=1.0, seed=1)
    g = with_edges(g.to(dtype=torch.float64), cutoff)
    order = pair_order(g.edge_index, g.shifts)
    n = g.edge_index.shape[1]
    assert order is not None and torch.equal(order.sort().values, torch.arange(n))
    ei, sh = g.edge_index[:, order], g.shifts[order]
    h = n // 2
    assert torch.equal(ei[:, h:], ei[:, :h].flip(0)) and torch.equal(sh[h:], -sh[:h])
    if volume < 10:
        assert bool((ei[0, :h] == ei[1, :h]).any())  # an atom paired with its own image
    vec = g.replace(edge_index=ei, shifts=sh).edge_vectors()
    assert torch.equal(vec[h:], -vec[:h])  # bitwise: the lengths of a pair are equal
    assert torch.equal((vec[h:] ** 2).sum(-1), (vec[:h] ** 2).sum(-1))


def test_pair_order_refuses_a_list_that_is_not_full():
    g = random_periodic_system(SPECIES, 6, volume_per_atom=11.0, min_distance=1.0, seed=1)
    g = with_edges(g, 3.5)
    ei, sh = g.edge_index, g.shifts
    assert pair_order(ei[:, 1:], sh[1:]) is None  # odd
    assert pair_order(ei[:, 2:], sh[2:]) is None  # two edges without their reverses
    bad = sh.clone()
    bad[0, 0] += 1
    assert pair_order(ei, bad) is None  # a shift that no reverse negates
    loop = torch.tensor([[0, 1], [0, 1]])
    assert pair_order(loop, torch.zeros(2, 3, dtype=torch.long)) is None  # i -> i, no shift
    assert pair_order(ei[:, :0], sh[:0]).numel() == 0


def test_the_cutoff_filter_keeps_pairs_together():
    """``within_cutoff_paired`` keeps the edges ``within_cutoff`` keeps, each half compacted
    into its half of the active capacity, so that they stay paired."""
    g = random_periodic_system(SPECIES, 12, volume_per_atom=11.0, min_distance=1.0, seed=2)
    g = _paired(with_edges(g.to(dtype=torch.float64), 4.0))
    cap = g.edge_index.shape[1]
    inert = (torch.zeros(2, cap, dtype=torch.long), torch.zeros(cap, 3, dtype=torch.long))
    ei, sh, n, broken = within_cutoff_paired(g, 3.0, inert)
    ref_ei, ref_sh, ref_n = within_cutoff(g, 3.0, inert)
    assert int(broken) == 0 and int(n) == int(ref_n) and 0 < int(n) < cap
    h, k = cap // 2, int(n) // 2
    assert torch.equal(ei[:, h:h + k], ei[:, :k].flip(0)) and torch.equal(sh[h:h + k], -sh[:k])
    kept = torch.cat([ei[:, :k], ei[:, h:h + k]], 1)
    key = lambda e: sorted(map(tuple, e.T.tolist()))  # noqa: E731
    assert key(kept) == key(ref_ei[:, :int(ref_n)])
    # a list whose halves are not reverses parts pairs: counted, never silently used
    rolled = g.replace(edge_index=torch.cat([g.edge_index[:, :h], g.edge_index[:, h:].roll(1, 1)],
                                            1), shifts=torch.cat([g.shifts[:h],
                                                                  g.shifts[h:].roll(1, 0)]))
    assert int(within_cutoff_paired(rolled, 3.0, inert)[3]) > 0


class PairDensity(AtomisticModel):
    """EAM-like ``E_i = -sqrt(rho_i + 0.01)``, ``rho_i = sum_{j -> i} g(r_ij)``: on a paired
    list ``g`` is evaluated on the first half only and reused for the reversed edges (a
    wrong pairing gives wrong densities, so a wrong energy)."""

    cutoff = 6.0

    def __init__(self):
        super().__init__()
        self.pairs_edges = True
        self.calls: list[tuple[bool, int]] = []

    def density(self, r2):
        x = r2 / self.cutoff ** 2
        return torch.where(x < 1, torch.exp(-r2 / 8.0) * (1 - x) ** 2, torch.zeros_like(x))

    def forward(self, graph):
        vec = graph.edge_vectors()
        r2 = (vec * vec).sum(-1)
        paired = edges_paired()
        self.calls.append((paired, r2.shape[0]))
        if paired:
            half = self.density(r2[: r2.shape[0] // 2])
            g = torch.cat([half, half])
        else:
            g = self.density(r2)
        rho = torch.zeros(graph.n_atoms, dtype=r2.dtype).index_add(0, graph.edge_index[1], g)
        return -torch.sqrt(rho + 0.01)


def test_compiled_step_on_a_paired_list_follows_eager(one_thread):
    """The paired compiled step (list, padding and active capacity in halves) gives the
    eager, unpaired trajectory of the pair-density model over rebuilds, compiling no more
    than the unpaired step (capacity growth only), and the model sees each pair's density
    once."""
    model = PairDensity().double()
    eager_pot, compiled_pot = Potential(model, skin=SKIN), Potential(model, skin=SKIN)
    eager_pot.paired = False  # the reference: the list as built
    stepper = CompiledVerlet(compiled_pot, backend="aot_eager")
    plain = CompiledVerlet(Potential(model, skin=SKIN), backend="aot_eager")
    plain.paired = False
    eager = compiled = unpaired = nve.init(_system(), eager_pot)
    model.calls.clear()
    for _ in range(60):
        eager, compiled = nve.step(eager, eager_pot, 2.0), stepper.step(compiled, 2.0)
        unpaired = plain.step(unpaired, 2.0)
    assert stepper.paired and stepper.n_rebuilds >= 2
    assert stepper.n_compiles == plain.n_compiles <= 2
    assert stepper.capacity % 2 == 0 and stepper.active_capacity % 2 == 0
    assert (True, stepper.active_capacity) in model.calls  # the traced call: paired
    assert (False, plain.active_capacity) in model.calls
    assert not edges_paired()
    torch.testing.assert_close(compiled.positions, unpaired.positions, rtol=0, atol=1e-12)
    torch.testing.assert_close(compiled.positions, eager.positions, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.forces, eager.forces, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.energy, eager.energy, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.stress, eager.stress, rtol=0, atol=1e-12)
    # a model without pairs_edges gets the list as built
    assert not CompiledVerlet(Potential(build("lj", sigma=3.4, epsilon=0.01, cutoff=6.0)),
                              backend="aot_eager").paired


@pytest.fixture
def naive_conv_fusion(monkeypatch):
    """mace's cuEquivariance conversion with the fused convolution (a CUDA-only choice of
    mace's) on the CPU, through cuEquivariance's pure-PyTorch segmented polynomial."""
    pytest.importorskip("mace")
    import mace.cli.convert_e3nn_cueq as convert
    import mace.modules.wrapper_ops as ops

    fuse, config = ops.with_cueq_conv_fusion, convert.CuEquivarianceConfig

    def naive(tp):
        tp.m.buffer_num_segments = [tp._polynomial_orig.inputs[0].size]
        tp.m.operand_extent = 1
        return fuse(tp)

    monkeypatch.setattr(ops, "with_cueq_conv_fusion", naive)
    monkeypatch.setattr(convert, "CuEquivarianceConfig",
                        lambda **kw: config(**{**kw, "conv_fusion": True}))


# unfused (CPU) and the default fusion (split) fast; the other two ways under -m slow
@requires_cue
@pytest.mark.parametrize("fused", [None, "split", pytest.param("index", marks=pytest.mark.slow),
                                   pytest.param("concat", marks=pytest.mark.slow)])
def test_mace_radial_networks_once_per_pair(fused, request, monkeypatch):
    """The MACE wrapper's cuEquivariance copy on a paired list: each interaction's radial MLP
    on half the edges, and the energies, forces and stress of the per-edge evaluation
    (fp64; fused: the convolution once per half of the edges, or once with the half-size
    weights read through its input index, or concatenated)."""
    from xnn.models.external import _mace_pairs

    if fused:
        request.getfixturevalue("naive_conv_fusion")
        monkeypatch.setattr(_mace_pairs, "FUSION", fused)
    model = build("mace", model=_tiny_mace(), backend="cueq").eval()
    assert model.pairs_edges and not build("mace", model=_tiny_mace()).pairs_edges
    g = random_periodic_system(SPECIES, 10, volume_per_atom=11.0, min_distance=1.0, seed=4)
    g = _paired(with_edges(g.to(dtype=torch.float64), 3.0))
    ref = compute_properties(model, g)
    copy = model._cueq[1]
    assert hasattr(copy.interactions[0], "conv_fusion") == bool(fused)
    rows, fusions = [], []
    for block in copy.interactions:
        block.conv_tp_weights.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
        if fused:  # (weight rows, edge rows) of each fused call
            conv, original = block.conv_tp, block.conv_tp.original_forward
            conv.original_forward = (lambda inputs, *a, f=original: fusions.append(
                (inputs[0].shape[0], inputs[2].shape[0])) or f(inputs, *a))
    with pairing_edges():
        out = compute_properties(model, g)
    h = g.edge_index.shape[1] // 2
    assert rows == [h] * 2
    assert fusions == {None: [], "split": [(h, h)] * 4, "index": [(h, 2 * h)] * 2,
                       "concat": [(2 * h, 2 * h)] * 2}[fused]
    for key in (K.ENERGIES, K.FORCES, K.STRESS):
        assert ref[key].abs().max() > 1e-6
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-12)


@requires_cue
def test_default_mace_fusion_indexes_nothing_sized_by_the_pairs(naive_conv_fusion):
    """The default fusion indexes only the node features: cuEquivariance compiles a kernel
    per size of an indexed input, and the eager step's pair count changes at every step (an
    H200 measured 0.3 s per call when the radial weights were read through an index)."""
    model = build("mace", model=_tiny_mace(), backend="cueq").eval()
    g = random_periodic_system(SPECIES, 10, volume_per_atom=11.0, min_distance=1.0, seed=4)
    g = _paired(with_edges(g.to(dtype=torch.float64), 3.0))
    compute_properties(model, g)  # (builds the cuEquivariance copy)
    n_atoms, indexed = g.positions.shape[0], []
    for block in model._cueq[1].interactions:
        conv, original = block.conv_tp, block.conv_tp.original_forward
        conv.original_forward = (lambda inputs, index, *a, f=original: indexed.extend(
            inputs[k].shape[0] for k in index) or f(inputs, index, *a))
    with pairing_edges():
        compute_properties(model, g)
    assert indexed and all(rows == n_atoms for rows in indexed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@requires_cue
@pytest.mark.parametrize("fusion", ["split", "index", "concat"])
def test_mace_pairs_cuda_fused_kernels_equal_per_edge(fusion, monkeypatch):
    """On CUDA (mace's own fused convolution, cuEquivariance's kernels), each way of giving
    the fused convolution the half-size weights gives the per-edge evaluation (fp32)."""
    from xnn.models.external import _mace_pairs

    monkeypatch.setattr(_mace_pairs, "FUSION", fusion)
    model = build("mace", model=_tiny_mace().float().cuda(), backend="cueq").eval()
    g = random_periodic_system(SPECIES, 40, volume_per_atom=11.0, min_distance=1.0, seed=5)
    g = _paired(with_edges(g.to(dtype=torch.float32, device="cuda"), 3.5))
    ref = compute_properties(model, g)
    assert hasattr(model._cueq[1].interactions[0], "conv_fusion")
    with pairing_edges():
        out = compute_properties(model, g)
    for key in (K.ENERGIES, K.FORCES, K.STRESS):
        assert ref[key].abs().max() > 1e-4
        torch.testing.assert_close(out[key], ref[key], rtol=1e-5, atol=1e-5)


def test_equivariant_radial_networks_once_per_pair():
    """xnn's equivariant model on a paired list (the compiled step's traced branch): each
    interaction's radial MLP on half the edges, the tensor products weighing both edges of a
    pair with its row, and the per-edge energies, forces and stress (fp64); a list whose
    halves are not reverses gives other energies (the pairing is used, not ignored)."""
    from xnn.models.base import tracing_graph

    model = _equivariant().eval()
    assert model.pairs_edges
    g = random_periodic_system(SPECIES, 10, volume_per_atom=11.0, min_distance=1.0, seed=4)
    g = _paired(with_edges(g.to(dtype=torch.float64), 4.0))  # beyond the cutoff too (skin)
    ref = compute_properties(model, g, True, True)
    rows = []
    for layer in model.interactions:
        layer.radial.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
    with tracing_graph(), pairing_edges():
        out = compute_properties(model, g, True, True)
    h = g.edge_index.shape[1] // 2
    assert rows == [h] * len(model.interactions)
    for key in (K.ENERGIES, K.FORCES, K.STRESS):
        assert ref[key].abs().max() > 1e-6
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-12)
    rolled = g.replace(edge_index=torch.cat([g.edge_index[:, :h], g.edge_index[:, h:].roll(1, 1)],
                                            1), shifts=torch.cat([g.shifts[:h],
                                                                  g.shifts[h:].roll(1, 0)]))
    with tracing_graph(), pairing_edges():
        wrong = compute_properties(model, rolled, False, False)
    assert (wrong[K.ENERGIES] - ref[K.ENERGIES]).abs().max() > 1e-6


@requires_cue
def test_equivariant_pairs_only_with_reference_kernels():
    """The cueq kernels take per-edge weights: the model then declares no pairing."""
    assert not _equivariant("cueq").pairs_edges


# the compiled paired step is checked fast with the pair-density model and SchNet, the
# equivariant model's pairing eagerly (test_equivariant_radial_networks_once_per_pair)
@pytest.mark.slow
def test_equivariant_compiled_step_on_a_paired_list_follows_eager(one_thread):
    """The compiled NVE step of the equivariant model on the paired list (radial MLPs once
    per pair) follows the eager trajectory over rebuilds, as the unpaired compiled step
    does."""
    model = _equivariant().eval()
    g = random_periodic_system(SPECIES, 12, volume_per_atom=11.0, min_distance=1.2, seed=6)
    g = maxwell_boltzmann(g.to(dtype=torch.float64), 900.0, seed=1)
    eager_pot = Potential(model, skin=0.3)
    eager_pot.paired = False  # the reference: the list as built
    stepper = CompiledVerlet(Potential(model, skin=0.3), backend="aot_eager")
    plain = CompiledVerlet(Potential(model, skin=0.3), backend="aot_eager")
    plain.paired = False
    rows = []
    model.interactions[0].radial.register_forward_hook(
        lambda m, i, o: rows.append(i[0].shape[0]))
    eager = compiled = unpaired = nve.init(g, eager_pot)
    for _ in range(25):
        eager, compiled = nve.step(eager, eager_pot, 1.0), stepper.step(compiled, 1.0)
        unpaired = plain.step(unpaired, 1.0)
    assert stepper.paired and stepper.n_rebuilds >= 2 and stepper.n_compiles <= 2
    # traced: the paired step's radial MLP on half its active capacity, the plain one's on all
    assert stepper.active_capacity // 2 in rows and plain.active_capacity in rows
    for a, b in ((compiled, unpaired), (compiled, eager)):
        torch.testing.assert_close(a.positions, b.positions, rtol=0, atol=1e-10)
        torch.testing.assert_close(a.forces, b.forces, rtol=0, atol=1e-10)
        torch.testing.assert_close(a.energy, b.energy, rtol=0, atol=1e-10)


def _schnet():
    torch.manual_seed(0)
    return build("schnet", species=SPECIES, cutoff=3.5, num_features=8, num_filters=8,
                 num_interactions=2, num_basis=6).double()


def _painn():
    torch.manual_seed(0)
    return build("painn", species=SPECIES, cutoff=3.5, num_features=8, num_interactions=2,
                 num_basis=6).double()


@pytest.mark.parametrize("name,skin", [("equivariant", 0.0), ("equivariant", 0.4),
                                       ("schnet", 0.4), ("painn", 0.4)])
def test_eager_potential_pairs_the_list(name, skin):
    """``Potential`` gives a model with ``pairs_edges`` its list as reverse pairs (arranged
    once per build, filtered to the cutoff pair by pair): the radial networks (equivariant
    radial MLP, SchNet filter) run on half the edges, and an NVE run over rebuilds follows
    the run on the list as built (fp64; PaiNN: its radial basis on half the edges, its
    filter after it); training evaluations and models without
    ``pairs_edges`` get the list as built."""
    model = {"equivariant": _equivariant, "schnet": _schnet, "painn": _painn}[name]().eval()
    radial = {"equivariant": lambda: model.interactions[0].radial,
              "schnet": lambda: model.interactions[0].filter,
              "painn": lambda: model.rbf}[name]()
    g = random_periodic_system(SPECIES, 12, volume_per_atom=11.0, min_distance=1.2, seed=6)
    g = maxwell_boltzmann(g.to(dtype=torch.float64), 900.0, seed=1)
    paired, plain = Potential(model, skin=skin), Potential(model, skin=skin)
    plain.paired = False
    assert paired.paired
    rows = []
    hook = radial.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
    edges, is_paired = paired.edges_for_model(g, paired=True)
    assert is_paired and not edges_paired()
    h = edges.n_edges // 2
    assert torch.equal(edges.edge_index[:, h:], edges.edge_index[:, :h].flip(0))
    assert torch.equal(edges.shifts[h:], -edges.shifts[:h])
    assert sorted(map(tuple, edges.edge_index.T.tolist())) == sorted(
        map(tuple, plain.model_graph(g).edge_index.T.tolist()))
    a = b = nve.init(g, paired)
    assert rows[-1] == h
    builds = paired.neighbors.n_builds
    for _ in range(15):
        a, b = nve.step(a, paired, 1.0), nve.step(b, plain, 1.0)
    assert paired.neighbors.n_builds >= builds + 2
    hook.remove()
    torch.testing.assert_close(a.positions, b.positions, rtol=0, atol=1e-11)
    torch.testing.assert_close(a.forces, b.forces, rtol=0, atol=1e-11)
    torch.testing.assert_close(a.energy, b.energy, rtol=0, atol=1e-11)
    torch.testing.assert_close(a.stress, b.stress, rtol=0, atol=1e-12)
    # training, and a model without pairs_edges: the list as built
    model.train()
    rows.clear()
    radial.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
    paired(g, training=True)
    assert rows == [paired.model_graph(g).n_edges]
    assert not Potential(build("lj", sigma=2.0, epsilon=0.01, cutoff=3.0)).paired


def test_schnet_compiled_step_on_a_paired_list_follows_eager(one_thread):
    """SchNet's compiled NVE step on the paired list (filters once per pair) follows the
    eager trajectory on the list as built."""
    model = _schnet().eval()
    g = random_periodic_system(SPECIES, 12, volume_per_atom=11.0, min_distance=1.2, seed=6)
    g = maxwell_boltzmann(g.to(dtype=torch.float64), 900.0, seed=1)
    eager_pot = Potential(model, skin=0.3)
    eager_pot.paired = False
    stepper = CompiledVerlet(Potential(model, skin=0.3), backend="aot_eager")
    eager = compiled = nve.init(g, eager_pot)
    for _ in range(25):
        eager, compiled = nve.step(eager, eager_pot, 1.0), stepper.step(compiled, 1.0)
    assert stepper.paired and stepper.n_rebuilds >= 2
    torch.testing.assert_close(compiled.positions, eager.positions, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.forces, eager.forces, rtol=0, atol=1e-10)


@requires_cue
def test_eager_potential_pairs_mace_cueq():
    """The MACE wrapper with cuEquivariance through ``Potential``: its radial MLPs on half
    the edges, and the energies, forces and stress of the list as built (fp64)."""
    model = build("mace", model=_tiny_mace(), backend="cueq").eval()
    g = random_periodic_system(SPECIES, 10, volume_per_atom=11.0, min_distance=1.0, seed=4)
    g = g.to(dtype=torch.float64)
    paired, plain = Potential(model, skin=0.5), Potential(model, skin=0.5)
    plain.paired = False
    ref = plain(g)
    rows = []
    for block in model._cueq_model(g.positions.device, g.dtype).interactions:
        block.conv_tp_weights.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
    out = paired(g)
    assert rows == [paired.model_graph(g).n_edges // 2] * 2
    for key in (K.ENERGIES, K.FORCES, K.STRESS):
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-12)

"""Tests of the ``equivariant`` model: xnn.testing contracts, body order, internal equivariance,
double backward, fp32, hyperparameter round trip."""

from __future__ import annotations

import itertools
import shutil

import numpy as np
import pytest
import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.models import build, compute_properties
from xnn.models.equivariant_ops import (  # o3 imported safely for e3nn 0.4.4
    EdgeTensorProduct,
    ProductBasis,
    block,
    coupling_paths,
    o3,
)
from xnn.neighbors import with_edges
from xnn.testing import (
    check_isolated_atom_e0,
    random_molecule,
    random_orthogonal,
    random_periodic_system,
    run_all_contracts,
)

SPECIES = [1, 8]


def small_model(**hp) -> torch.nn.Module:
    torch.manual_seed(hp.pop("seed", 0))
    base = dict(
        species=SPECIES, cutoff=3.5, channels=6, l_max=2, hidden_l_max=1, correlation=3,
        num_bessel=6, radial_mlp=[12], avg_num_neighbors=4.0,
    )
    base.update(hp)
    return build("equivariant", **base).double()


def energy(model, graph: AtomicGraph) -> torch.Tensor:
    g = with_edges(graph.without_edges(), model.cutoff)
    return compute_properties(model, g, forces=False, stress=False)[K.ENERGY]


def test_contracts():
    run_all_contracts(small_model(), species=SPECIES)


def test_contracts_scalar_hidden_features():
    model = small_model(hidden_l_max=0, l_max=3, num_interactions=3, correlation=2)
    run_all_contracts(model, species=SPECIES, skip=("stress_fd", "supercell", "cutoff_smoothness"))


def test_isolated_atom_energy_is_e0():
    # values exact in fp32: EnergyScaleShift stores e0 in the default dtype at construction
    model = small_model(e0={1: -13.625, 8: -432.125})
    check_isolated_atom_e0(model, 1, -13.625, atol=1e-12)
    check_isolated_atom_e0(model, 8, -432.125, atol=1e-12)


def _four_body_residual(model, pos: np.ndarray, numbers: list[int]) -> float:
    """E(1234) - Σ E(ijk) + Σ E(ij) - Σ E(i): zero for any sum of <= 3-body terms."""
    graphs, signs = [], []
    for k in range(1, 5):
        for sub in itertools.combinations(range(4), k):
            graphs.append(AtomicGraph.from_arrays(pos[list(sub)], [numbers[i] for i in sub]))
            signs.append((-1) ** (4 - k))
    e = energy(model, AtomicGraph.concat(graphs))
    return float((e * torch.tensor(signs, dtype=e.dtype)).sum())


def test_body_order_follows_correlation():
    """One interaction and a linear readout make the energy an exact (ν+1)-body expansion.

    Without the first-layer self-connection: its gate ``1 - exp(-Σ envelopes)`` is a smooth
    many-body function (1 to within 1e-5 in condensed matter) that keeps isolated atoms at E0.
    """
    pos = np.array([[0.0, 0.0, 0.0], [1.3, 0.2, -0.1], [-0.4, 1.2, 0.3], [0.2, -0.5, 1.4]])
    numbers = [8, 1, 1, 8]
    res = {}
    for nu in (1, 2, 3):
        model = small_model(num_interactions=1, correlation=nu, readout_hidden=0, seed=3,
                            first_self_connection=False)
        res[nu] = abs(_four_body_residual(model, pos, numbers))
    total = float(energy(small_model(num_interactions=1, readout_hidden=0, seed=3,
                                     first_self_connection=False),
                         AtomicGraph.from_arrays(pos, numbers)).abs())
    assert res[1] < 1e-12 * max(total, 1.0) and res[2] < 1e-12 * max(total, 1.0), res
    assert res[3] > 1e-6 * total, (res, total)


def test_three_body_angle_dependence():
    """Two neighbours out of each other's range: the energy depends on the angle iff ν >= 2."""

    def trimer(theta):
        r1, r2 = 1.9, 2.1
        pos = [[0, 0, 0], [r1, 0, 0], [r2 * np.cos(theta), r2 * np.sin(theta), 0]]
        return AtomicGraph.from_arrays(pos, [8, 1, 1])

    for nu in (1, 2):
        model = small_model(num_interactions=1, correlation=nu, seed=1, cutoff=3.0)
        # r_12 >= 3.46 Å > cutoff at both angles
        e = energy(model, AtomicGraph.concat([trimer(2.0), trimer(2.6)]))
        diff = float((e[0] - e[1]).abs())
        if nu == 1:
            assert diff < 1e-13, diff
        else:
            assert diff > 1e-8, diff


def test_product_basis_is_polynomial_of_degree_correlation():
    """B(λA) is a polynomial of degree exactly ``correlation`` in λ (body order ν + 1)."""
    torch.manual_seed(0)
    pb = ProductBasis(num_species=2, channels=3, l_max=2, l_out=1, correlation=3).double()
    a = torch.randn(5, 3, 9, dtype=torch.float64)
    z = torch.tensor([0, 1, 1, 0, 1])
    lams = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0], dtype=torch.float64)
    vals = torch.stack([pb(lam * a, z).flatten() for lam in lams])  # [5, n]
    vander = torch.stack([lams**k for k in range(4)], dim=1)  # cubic fit on the first 4 points
    coef = torch.linalg.solve(vander[:4], vals[:4])
    assert torch.allclose(vander[4] @ coef, vals[4], atol=1e-10)  # no higher degree
    assert coef[3].abs().max() > 1e-3  # degree 3 present
    assert coef[0].abs().max() < 1e-12  # B(0) = 0


def test_internal_features_equivariant():
    """Node features of every degree transform with Wigner D (rotations and reflections)."""
    model = small_model(hidden_l_max=2, num_interactions=2)
    mol = random_molecule(SPECIES, 6, volume_per_atom=8.0, min_distance=1.5, seed=4)
    rng = np.random.default_rng(0)
    for proper in (True, False):
        rot = torch.tensor(random_orthogonal(rng, proper=proper))
        g1 = with_edges(mol, model.cutoff)
        g2 = with_edges(mol.replace(positions=mol.positions @ rot.T), model.cutoff)
        h1, h2 = model.node_features(g1)[0], model.node_features(g2)[0]
        d = _wigner_d(2, rot)
        assert h1[:, :, 1:].abs().max() > 1e-6  # l > 0 features are not trivially zero
        torch.testing.assert_close(h2, h1 @ d.T, atol=1e-12, rtol=1e-10)
        layer = model.interactions[0]
        a = [layer.aggregate(model.embedding(g.numbers)[..., None], model.edge_features(g))
             for g in (g1, g2)]
        d3 = _wigner_d(model.l_max, rot)
        torch.testing.assert_close(a[1], a[0] @ d3.T, atol=1e-12, rtol=1e-10)


def _wigner_d(l_max: int, rot: torch.Tensor) -> torch.Tensor:
    """Block-diagonal Wigner D of degrees 0..l_max (natural parity), computed in float64."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # e3nn builds its generators in the default dtype
    try:
        return o3.Irreps.spherical_harmonics(l_max).D_from_matrix(rot)
    finally:
        torch.set_default_dtype(old)




def test_double_backward_matches_finite_difference():
    model = small_model()
    mol = random_molecule(SPECIES, 5, volume_per_atom=10.0, min_distance=1.2, seed=2)
    g = with_edges(mol, model.cutoff)
    param = model.interactions[0].radial.net[0].weight

    def loss():
        out = compute_properties(model, g, stress=False, training=True)
        return (out[K.FORCES] ** 2).sum()

    (grad,) = torch.autograd.grad(loss(), [param])
    assert torch.isfinite(grad).all() and grad.abs().max() > 0
    delta = 1e-5
    with torch.no_grad():
        param[0, 0] += delta
        up = float(loss())
        param[0, 0] -= 2 * delta
        down = float(loss())
        param[0, 0] += delta
    fd = (up - down) / (2 * delta)
    assert abs(fd - float(grad[0, 0])) <= 1e-6 * abs(fd) + 1e-10, (fd, float(grad[0, 0]))


def test_float32_matches_float64():
    model64 = small_model()
    model32 = small_model().float()
    mol = random_molecule(SPECIES, 6, volume_per_atom=10.0, min_distance=1.2, seed=5)
    o64 = compute_properties(model64, with_edges(mol, 3.5))
    o32 = compute_properties(model32, with_edges(mol.to(dtype=torch.float32), 3.5))
    assert o32[K.FORCES].dtype == torch.float32
    torch.testing.assert_close(o32[K.FORCES].double(), o64[K.FORCES], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(o32[K.ENERGY].double(), o64[K.ENERGY], atol=1e-5, rtol=1e-5)


def test_hparams_rebuild_and_sync_points():
    model = small_model(num_interactions=3)
    clone = build("equivariant", **model.hparams).double()
    clone.load_state_dict(model.state_dict())
    mol = random_molecule(SPECIES, 5, volume_per_atom=10.0, min_distance=1.2, seed=6)
    torch.testing.assert_close(energy(clone, mol), energy(model, mol), atol=0, rtol=0)
    assert model.receptive_field == pytest.approx(3 * 3.5)

    calls = []

    class Doubling(torch.nn.Module):  # a sync point that changes features must change E
        def forward(self, features, graph):
            calls.append(tuple(features.shape))
            return 2 * features

    for name, _ in clone.sync_points:
        clone.set_sync_point(name, Doubling())
    e = energy(clone, mol)
    assert len(calls) == 2 and calls[0] == (5, 6 * 4)
    assert not torch.allclose(e, energy(model, mol))


def test_invalid_hyperparameters():
    with pytest.raises(InputError, match="hidden_l_max"):
        build("equivariant", species=SPECIES, l_max=1, hidden_l_max=2)
    with pytest.raises(InputError, match="correlation"):
        build("equivariant", species=SPECIES, correlation=0)


def _cg(l1, l2, l3):
    return o3.wigner_3j(l1, l2, l3, dtype=torch.float64) * (2 * l3 + 1) ** 0.5


def test_edge_tensor_product_matches_per_path_reference():
    torch.manual_seed(0)
    tp = EdgeTensorProduct(l_in=1, l_sh=2, l_out=2).double()
    e, c = 7, 3
    x, y = torch.randn(e, c, 4, dtype=torch.float64), torch.randn(e, 9, dtype=torch.float64)
    w = torch.randn(e, c, tp.num_paths, dtype=torch.float64)
    ref = torch.zeros(e, c, 9, dtype=torch.float64)
    paths = coupling_paths(1, 2, 2)
    assert len(paths) == 7 and all((a + b + d) % 2 == 0 for a, b, d in paths)
    for k, (l1, l2, l3) in enumerate(paths):
        n_into = sum(1 for p in paths if p[2] == l3)
        t = torch.einsum("eca,eb,abk->eck", x[:, :, block(l1)], y[:, block(l2)], _cg(l1, l2, l3))
        ref[:, :, block(l3)] += w[:, :, k, None] * t / n_into**0.5
    torch.testing.assert_close(tp(x, y, w), ref, atol=1e-12, rtol=1e-12)


def test_product_basis_matches_per_path_reference():
    torch.manual_seed(1)
    pb = ProductBasis(num_species=2, channels=3, l_max=2, l_out=1, correlation=3).double()
    a = torch.randn(4, 3, 9, dtype=torch.float64)
    z = torch.tensor([0, 1, 1, 0])

    def couple(b, w, l3_max):
        paths = coupling_paths(2, 2, l3_max)
        out = torch.zeros(b.shape[0], 3, (l3_max + 1) ** 2, dtype=torch.float64)
        for k, (l1, l2, l3) in enumerate(paths):
            n_into = sum(1 for p in paths if p[2] == l3)
            t = torch.einsum("nca,ncb,abk->nck", b[:, :, block(l1)], a[:, :, block(l2)],
                             _cg(l1, l2, l3))
            out[:, :, block(l3)] += w[:, :, k, None] * t / n_into**0.5
        return out

    b2 = couple(a, pb.weights[0][z], 2)
    b3 = couple(b2, pb.weights[1][z], 1)
    u = pb.out_weights[z][..., torch.tensor([0, 1, 1, 1])]  # [n, ν, C, 4]
    ref = a[:, :, :4] * u[:, 0] + b2[:, :, :4] * u[:, 1] + b3 * u[:, 2]
    torch.testing.assert_close(pb(a, z), ref, atol=1e-12, rtol=1e-12)


def test_chunked_edges_match_unchunked():
    """Receiver chunks under checkpointing give the same energy, forces, stress and
    force-loss parameter gradients (double backward) as the one-shot evaluation."""
    system = random_periodic_system(SPECIES, 8, volume_per_atom=12.0, min_distance=1.3, seed=7)
    g = with_edges(system, 3.5 + 0.5)  # a Verlet skin, unsorted edges
    perm = torch.randperm(g.n_edges, generator=torch.Generator().manual_seed(0))
    g = g.replace(edge_index=g.edge_index[:, perm], shifts=g.shifts[:, :][perm])
    results = []
    for chunk in (None, 37):
        model = small_model(edge_chunk_size=chunk)
        out = compute_properties(model, g, training=True)
        loss = (out[K.FORCES] ** 2).sum() + (out[K.STRESS] ** 2).sum()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        results.append((out, grads))
    (o1, g1), (o2, g2) = results
    for key in (K.ENERGY, K.FORCES, K.STRESS):
        torch.testing.assert_close(o2[key], o1[key], atol=1e-12, rtol=1e-10)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-9)
    model = small_model(edge_chunk_size=37)
    assert len(model.edge_features(g).chunks) >= 3


def test_auto_chunking_follows_available_memory(monkeypatch):
    """``edge_chunk_size="auto"`` evaluates at once when the per-edge tensors fit and in
    receiver chunks when they would not; both give the same energy, forces and stress."""
    import xnn.models.equivariant as eq

    system = random_periodic_system(SPECIES, 8, volume_per_atom=12.0, min_distance=1.3, seed=3)
    g = with_edges(system, 3.5)
    model = small_model()
    assert model.edge_chunk_size == "auto"
    assert model.edge_features(g).chunks is None  # plenty of memory here
    full = compute_properties(model, g)
    monkeypatch.setattr(eq, "AUTO_CHUNK", 50)
    assert model.edge_features(g).chunks is None  # still fits
    monkeypatch.setattr(eq, "available_memory", lambda device: g.n_edges * 100)
    assert len(model.edge_features(g).chunks) >= 3  # would not fit: chunked
    chunked = compute_properties(model, g)
    for key in (K.ENERGY, K.FORCES, K.STRESS):
        torch.testing.assert_close(chunked[key], full[key], atol=1e-12, rtol=1e-10)
    with pytest.raises(InputError, match="edge_chunk_size"):
        small_model(edge_chunk_size=0)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.slow  # ~18 s on 2 cores; the compiled equivariant double backward stays fast
def test_compiled_inference_matches_eager():
    """``compile_for_inference`` (torch.compile of the edge part) gives the same energy, forces
    and stress as eager mode, also after the edge count changes (dynamic shapes)."""
    model = small_model()
    systems = [random_periodic_system(SPECIES, n, volume_per_atom=12.0, min_distance=1.3,
                                      seed=n) for n in (6, 9)]
    graphs = [with_edges(s, 3.5 + 0.3) for s in systems]  # Verlet skin: some edges dropped
    eager = [compute_properties(model, g) for g in graphs]
    assert model.compile_for_inference()
    try:
        compiled = [compute_properties(model, g) for g in graphs]
    finally:
        model.compile_for_inference(False)
    for e, c in zip(eager, compiled):
        for key in (K.ENERGY, K.FORCES, K.STRESS):
            torch.testing.assert_close(c[key], e[key], atol=1e-12, rtol=1e-10)


def test_empty_graph_and_isolated_atoms():
    """An empty domain (0 atoms) and atoms without neighbours evaluate without error."""
    model = small_model(e0={1: -1.0, 8: -2.0})
    empty = AtomicGraph.from_arrays(np.zeros((0, 3)), np.zeros(0, dtype=int), np.eye(3) * 5, True)
    out = compute_properties(model, with_edges(empty, model.cutoff))
    assert out[K.FORCES].shape == (0, 3) and float(out[K.ENERGY][0]) == 0.0
    far = AtomicGraph.from_arrays([[0, 0, 0], [10, 0, 0]], [1, 8])
    torch.testing.assert_close(energy(model, far), torch.tensor([-3.0], dtype=torch.float64))


@pytest.mark.slow
def test_torch_export_matches_eager(tmp_path):
    """torch.export (no data-dependent edge filtering when tracing) gives the same energies and
    forces, with Verlet-skin edges present."""
    from xnn.models.serialization import export_model, load_exported

    model = small_model(num_interactions=2).float()
    path = export_model(model, tmp_path / "eq.pt2")
    exported, _ = load_exported(path, trust=True)
    system = random_periodic_system(SPECIES, 6, volume_per_atom=12.0, min_distance=1.3, seed=1)
    g = with_edges(system.to(dtype=torch.float32), model.cutoff + 0.7)
    pos = [g.positions.clone().requires_grad_(True) for _ in range(2)]
    e1 = exported(pos[0], g.numbers, g.cell, g.pbc, g.batch, g.edge_index, g.shifts.long())
    e2 = model(g.replace(positions=pos[1]))
    f1, f2 = (torch.autograd.grad(e.sum(), p)[0] for e, p in zip((e1, e2), pos))
    torch.testing.assert_close(e1, e2, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(f1, f2, atol=1e-6, rtol=1e-5)


def test_model_file_without_first_self_connection_loads_as_before(tmp_path):
    """Files written before ``first_self_connection`` existed rebuild the model they held."""
    from xnn import load_model, save_model

    old = small_model(first_self_connection=False, seed=5)
    save_model(old, tmp_path / "m.pt")
    payload = torch.load(tmp_path / "m.pt", weights_only=True)
    del payload["hparams"]["first_self_connection"]  # as saved by earlier versions
    torch.save(payload, tmp_path / "old.pt")
    new = load_model(tmp_path / "old.pt")
    assert new.hparams["first_self_connection"] is False
    g = AtomicGraph.from_arrays(np.array([[0.0, 0, 0], [1.1, 0.2, 0], [0, 1.3, 0.4]]), [8, 1, 1])
    assert torch.equal(energy(old, g), energy(new, g))


def test_first_self_connection_gate_is_one_in_condensed_matter():
    """The gate ``1 - exp(-density)`` of the first self-connection: ~1 with neighbours."""
    from ase.build import bulk

    torch.manual_seed(0)
    model = build("equivariant", species=[29], cutoff=5.0, channels=4, avg_num_neighbors=40.0)

    a = bulk("Cu", "fcc", a=3.61, cubic=True)
    g = with_edges(AtomicGraph.from_arrays(a.positions, a.numbers, a.cell[:], a.pbc), 5.0)
    density = model.edge_features(g).density
    assert density is not None and bool((-torch.expm1(-density) > 1 - 1e-5).all()), density


def test_checkpoint_without_first_self_connection_is_the_same_architecture():
    """A training checkpoint written before ``first_self_connection`` existed matches a config
    that sets it to False (the value it implied), and not one that leaves the new default."""
    from xnn.training.checkpoint import check_same_architecture

    old = small_model(first_self_connection=False)
    hp = dict(old.hparams)
    del hp["first_self_connection"]
    payload = {"model": {"name": "equivariant", "hparams": hp}}
    check_same_architecture(payload, old, "old.pt")
    with pytest.raises(InputError, match="first_self_connection"):
        check_same_architecture(payload, small_model(), "old.pt")

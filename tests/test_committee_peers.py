"""Committees of peer models (MACE and SevenNet wrappers): one model file, loaded back with
the same predictions and spread bitwise, under the trust rules (a member that would unpickle
needs the caller's trust); ``xnn committee`` assembles one from separately saved files."""

from __future__ import annotations

import io

import pytest
import torch
from helpers.models import MACE_SPECIES, mace_model, si_cu_periodic

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError, ModelFileError, TrustError
from xnn.models import build
from xnn.models.committee import MEMBERS_KIND, Committee
from xnn.models.derivatives import compute_properties
from xnn.models.serialization import load_model, model_metadata, save_model
from xnn.neighbors import with_edges

pytest.importorskip("mace")
KEYS = (K.ENERGY, K.FORCES, K.STRESS, K.ENERGY_STD, K.FORCES_STD, K.STRESS_STD,
        K.FORCES_MEMBERS)


def periodic_graph(cutoff: float) -> AtomicGraph:
    atoms = si_cu_periodic()
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                dtype=torch.float64)
    return with_edges(g, cutoff, backend="brute")


@pytest.fixture(scope="module")
def members() -> list:
    """Three wrapped random-weight MACE models (seeds 0, 1, 2), built once for the module
    (each build takes seconds; a committee only holds its members, never changes them)."""
    return [build("mace", model=mace_model(seed)) for seed in range(3)]


def assert_same_predictions(a, b, graph) -> dict:
    out_a, out_b = compute_properties(a, graph), compute_properties(b, graph)
    for key in KEYS:
        assert torch.equal(out_a[key], out_b[key]), key
    return out_a


def test_mace_committee_is_one_model_file_loaded_back_bitwise(members, tmp_path):
    committee = Committee(members, calibration={"forces": 1.7})
    assert committee.stores_members and committee.hparams is None
    path = save_model(committee, tmp_path / "committee.pt")
    meta = model_metadata(path)
    assert meta["name"] == "committee" and meta["kind"] == MEMBERS_KIND
    assert len(meta["members"]) == 3 and meta["species"] == MACE_SPECIES
    loaded = load_model(path)
    assert type(loaded) is Committee and loaded.committee_size == 3
    assert [type(m).__name__ for m in loaded.members] == ["MACEWrapper"] * 3
    assert loaded.calibration["forces"] == 1.7 and loaded.seeds is None
    g = periodic_graph(committee.cutoff)
    out = assert_same_predictions(committee, loaded, g)
    # each member is the MACE model it was built from, and they disagree
    for k, member in enumerate(members):
        alone = compute_properties(member, g)
        assert torch.equal(out[K.FORCES_MEMBERS][k], alone[K.FORCES])
    assert float(out[K.FORCES_STD].min()) > 0
    # saved again from the loaded committee: the same file contents
    again = load_model(save_model(loaded, tmp_path / "again.pt"))
    assert_same_predictions(committee, again, g)


def test_member_that_would_unpickle_needs_trust(members, tmp_path):
    """A committee file whose member payload holds a pickled MACE module (the format of
    earlier xnn versions) is refused without trust and loads with it."""
    from xnn.models.external._optional import preserved_environ
    from xnn.models.serialization import model_payload

    members = members[:2]
    payload = model_payload(Committee(members))
    buf = io.BytesIO()
    with preserved_environ():
        torch.save(members[1].model, buf)  # the raw mace-torch module of member 1
    old = payload["members"][1]
    for key in ("config", "state_dict"):
        old.pop(key)
    old.update(kind="mace-torch-pickle", module_bytes=buf.getvalue())
    path = tmp_path / "mixed.pt"
    torch.save(payload, path)
    with pytest.raises(TrustError, match=r"mixed\.pt"):
        load_model(path)
    trusted = load_model(path, trust=True)
    assert_same_predictions(Committee(members), trusted, periodic_graph(trusted.cutoff))


def assemble_separate_files(members, other, kind, tmp_path, capsys):
    """``xnn committee`` on the members' files: one committee file with their predictions;
    refusals of one line each (one file; a member ``other`` of another kind or cutoff; a
    committee given as a member), nothing written."""
    from xnn.cli.main import main

    files = [save_model(m, tmp_path / f"m{k}.pt") for k, m in enumerate(members)]
    rc = main(["committee", *map(str, files), "-o", str(tmp_path / "c.pt")])
    assert rc == 0 and f"a committee of 3 {kind} members" in capsys.readouterr().out
    built = load_model(tmp_path / "c.pt")
    assert [type(m) for m in built.members] == [type(m) for m in members]
    # the committee of the models the files were saved from
    out = assert_same_predictions(Committee(members), built, periodic_graph(built.cutoff))
    assert float(out[K.FORCES_STD].min()) > 0
    other = save_model(other, tmp_path / "other.pt")
    for argv, match in [([files[0]], "at least 2 model files"),
                        ([files[0], other], "differs from member 0"),
                        ([files[0], tmp_path / "c.pt"], "committees themselves")]:
        rc = main(["committee", *map(str, argv), "-o", str(tmp_path / "bad.pt")])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and match in err[0], err
        assert not (tmp_path / "bad.pt").exists()


def test_xnn_committee_assembles_separate_native_files(tmp_path, capsys):
    """The command on native members (3 SchNet seeds; a PaiNN file differs from them)."""
    from helpers.models import SMALL

    def schnet(seed):
        torch.manual_seed(seed)
        return build("schnet", species=MACE_SPECIES, cutoff=3.2, **SMALL["schnet"]).double()

    other = build("painn", species=MACE_SPECIES, cutoff=3.2, **SMALL["painn"]).double()
    assemble_separate_files([schnet(k) for k in range(3)], other, "schnet", tmp_path, capsys)


@pytest.mark.slow  # each MACE file written or read builds its module (seconds each)
def test_xnn_committee_assembles_separate_mace_files(members, tmp_path, capsys):
    other = build("schnet", species=MACE_SPECIES, cutoff=3.2).double()
    assemble_separate_files(members, other, "mace", tmp_path, capsys)


def test_native_committee_file_format_is_unchanged(tmp_path):
    """A committee of native members keeps its hparams format (one spec, K seeds)."""
    from helpers.models import SMALL

    spec = {"name": "schnet", "species": [29], "cutoff": 3.0, **SMALL["schnet"]}
    committee = Committee(spec, size=2, seeds=[3, 4]).double()
    path = save_model(committee, tmp_path / "native.pt")
    meta = model_metadata(path)
    assert "kind" not in meta and meta["hparams"]["member"]["name"] == "schnet"
    assert meta["hparams"]["seeds"] == [3, 4]
    loaded = load_model(path)
    assert loaded.seeds == [3, 4] and not loaded.stores_members


@pytest.mark.slow
def test_sevenn_committee_round_trip(tmp_path):
    """Two SevenNet-0 members (the second's weights perturbed) saved as one file."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = build("sevenn", checkpoint="7net-0").double(), \
            build("sevenn", checkpoint="7net-0").double()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(1 + 0.01 * torch.randn_like(p))
    committee = Committee([a, b])
    loaded = load_model(save_model(committee, tmp_path / "7net.pt"))
    assert [type(m).__name__ for m in loaded.members] == ["SevenNetWrapper"] * 2
    out = assert_same_predictions(committee, loaded, periodic_graph(committee.cutoff))
    assert float(out[K.FORCES_STD].max()) > 0


def test_refusals(members):
    with pytest.raises(InputError, match="at least 2 members"):
        Committee(members[:1])
    with pytest.raises(ModelFileError, match="lacks its members"):
        Committee.from_payload({"kind": MEMBERS_KIND, "members": "x"})

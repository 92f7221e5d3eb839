"""Batches crossing from DataLoader workers packed in one buffer (issue 45): the training
process gets bitwise the graphs the worker built, one shared-memory tensor a share."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import structures as S

from xnn.data import keys as K
from xnn.data.datasets import InMemoryDataset, collate, normalize_labels
from xnn.data.packed import ALIGN, pack
from xnn.neighbors.datasets import WithEdges
from xnn.training.loader import ShareLoader, ShareReader
from xnn.training.sharding import BatchSharding


def _identical(a: dict, b: dict) -> None:
    """The same names, dtypes, shapes and bits (NaN = NaN)."""
    assert list(a) == list(b)
    for key in a:
        x, y = a[key], b[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), key


def test_pack_round_trips_every_dtype_shape_and_stride():
    """Views of one buffer: non-contiguous, empty, zero-dimensional, bool, int32 and NaN
    fields come back bitwise with their dtypes and shapes, each 64-byte aligned."""
    rng = torch.Generator().manual_seed(0)
    fields = {
        "positions": torch.randn(7, 3, generator=rng, dtype=torch.float64),
        "transposed": torch.randn(3, 5, generator=rng).t(),  # float32, not contiguous
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        "empty": torch.zeros(0, 3, dtype=torch.float64),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "pbc": torch.tensor([[True, False, True]]),
        "shifts": torch.randint(-2, 3, (11, 3), generator=rng, dtype=torch.int32),
        "edge_index": torch.randint(0, 7, (2, 11), generator=rng),
        "half": torch.randn(4, generator=rng).to(torch.bfloat16),  # no numpy dtype
        "grad": torch.randn(2, 3, generator=rng, requires_grad=True),
    }
    packed = pack(fields)
    out = packed.unpack()
    _identical(out, {k: v.detach().contiguous() for k, v in fields.items()})
    assert packed.buffer.dtype == torch.uint8 and packed.buffer.ndim == 1
    assert all(offset % ALIGN == 0 for *_, offset in packed.layout)
    assert all(t.data_ptr() - packed.buffer.data_ptr() == off  # views, not copies
               for t, (*_, off) in zip(out.values(), packed.layout) if t.numel())
    with pytest.raises(ValueError, match="CPU"):
        pack({"x": torch.zeros(1, device="meta")})


def _edges_dataset():
    graphs = [normalize_labels(g) for g in (S.cubic(), S.triclinic(), S.molecule(), S.slab(),
                                            S.tiny(), S.cluster())]
    graphs[2] = graphs[2].replace({K.ENERGY: torch.tensor([-1.5], dtype=torch.float64)})
    return WithEdges(InMemoryDataset(graphs), 4.0, cache=False)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_shares_through_workers_equal_the_unpacked_read():
    """Shares read by 2 workers and unpacked in this process: bitwise the fields of
    collating the same structures here (the path without workers), in order."""
    ds = _edges_dataset()
    shares = [(3, 0, 5), (1,), (2, 4, 0, 1), (5, 3)]
    loader = ShareLoader(ds, BatchSharding().load, num_workers=2, collate=True)
    got = list(loader.read(shares))
    assert len(got) == len(shares)
    for share, (graphs, refused) in zip(shares, got):
        assert refused is None and len(graphs) == 1
        want = collate([ds[i] for i in share]).fields
        _identical(graphs[0].fields, {k: want[k] for k in graphs[0].fields})
        assert set(graphs[0].fields) == set(want)
        assert graphs[0].edge_index.shape[1] > 0
    # one packed buffer a graph where a share stays one graph per structure (decomposed
    # training): the same fields unpacked
    load = BatchSharding(without_edges=True).load
    sent, refused = ShareReader(ds, load, collate=False)[shares[0]]
    assert refused is None and len(sent) == len(shares[0])
    for packed, i in zip(sent, shares[0]):
        _identical(packed.unpack(), ds.without_edges(i).fields)
    assert np.all([p.buffer.ndim == 1 for p in sent])

"""v2: the models' sync points become halo feature exchanges under domain decomposition.

Between interaction layers a model passes per-atom features through its sync points
(identities in one process). Under DD each sync point is replaced by :class:`HaloSync`, which
overwrites the ghosts' features by their owners' features, so a halo of one cutoff suffices
whatever the number of layers.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import Tensor, nn

from xnn.data.graph import AtomicGraph


class HaloSync(nn.Module):
    """Replace ghost rows of ``features [n_local, ...]`` by their owners' rows.

    ``domain`` gives ``n_owned`` and ``gather_local`` (owned rows -> local rows): a halo
    exchange for a spatial domain, an all-gather for a graph-parallel one.
    """

    def __init__(self, domain, tape: list[Tensor]):
        super().__init__()
        self.domain = domain
        self.tape = tape

    def forward(self, features: Tensor, graph: AtomicGraph) -> Tensor:
        out = self.domain.gather_local(features[: self.domain.n_owned])
        self.tape.append(out)
        return out


@contextmanager
def swapped_sync_points(model, domain, tape: list[Tensor], enabled: bool = True):
    """Within the block, ``model``'s sync points are :class:`HaloSync` exchanges."""
    points = list(model.sync_points) if enabled else []
    originals = [(name, module) for name, module in points]
    try:
        for name, _ in originals:
            model.set_sync_point(name, HaloSync(domain, tape))
        yield
    finally:
        for name, module in originals:
            model.set_sync_point(name, module)

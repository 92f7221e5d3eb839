"""Labelled data, small models and an SGD trainer of the (context-parallel) training tests;
``xnn train`` of a small SchNet (the committee tests)."""

from __future__ import annotations

import numpy as np
import torch

from xnn.data.graph import AtomicGraph

from .models import native
from .structures import fcc

CUTOFF = 3.0


def labelled(atoms, seed, weight=1.0):
    """A graph with permuted atom ids and random labels (energy, forces, stress, weight)."""
    from xnn.neighbors import with_edges

    rng = np.random.default_rng(seed)
    n = len(atoms)
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                atom_id=rng.permutation(n))
    g = with_edges(g, CUTOFF)
    t = torch.float64
    stress = torch.tensor(rng.normal(0, 0.01, (3, 3)), dtype=t)
    return g.replace(energy=torch.tensor([rng.normal(-3.0 * n, 1.0)], dtype=t),
                     forces=torch.tensor(rng.normal(0, 0.3, (n, 3)), dtype=t),
                     stress=(0.5 * (stress + stress.T)).reshape(1, 3, 3),
                     weight=torch.tensor([weight], dtype=t))


def labelled_periodic(seed=0):
    atoms = fcc((2, 2, 2), seed=seed)  # 32 atoms, triclinic cell
    cell = atoms.cell.array.copy()
    cell[1] += 0.3 * cell[0]
    atoms.set_cell(cell, scale_atoms=True)
    return labelled(atoms, seed, weight=1.5)


def labelled_slab(seed=1):
    atoms = fcc((3, 2, 2), seed=seed)  # 48 atoms, vacuum along z
    atoms.cell[2] *= 2.5
    atoms.pbc = (True, True, False)
    return labelled(atoms, seed)


def labelled_molecule(seed=2, reps=(2, 2, 2)):
    atoms = fcc(reps, rattle=0.12, seed=seed)
    atoms.pbc = False
    atoms.cell[:] = 0.0
    return labelled(atoms, seed, weight=0.7)


def labelled_structures():
    return [labelled_periodic(0), labelled_slab(1), labelled_molecule(2), labelled_periodic(3)]


def train_model(name):
    """A small model; ``"NAME+ckpt"``: with activation checkpointing (same weights);
    ``"NAME+heads"``: with the readout heads ``a`` and ``b`` (:func:`two_heads`)."""
    name, _, extra = name.partition("+")
    if extra == "heads":
        return two_heads(native(name, cutoff=CUTOFF))
    return native(name, cutoff=CUTOFF, activation_checkpointing=extra == "ckpt")


def two_heads(model):
    """``model`` with the readout heads ``a`` and ``b``, head ``b``'s weights moved by seeded
    noise (so the heads predict differently)."""
    from xnn.models.heads import make_multihead

    model = make_multihead(model, ["a", "b"])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("readout_heads.1."):
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def with_heads(graphs, heads):
    """``graphs`` each with its ``head [1]`` field (:data:`xnn.data.keys.HEAD`)."""
    from xnn.data import keys as K

    return [g.replace({K.HEAD: torch.tensor([int(h)], device=g.device)})
            for g, h in zip(graphs, heads)]


def specs():
    from xnn.training.losses import TermSpec

    return {"energy": TermSpec(1.0), "forces": TermSpec(10.0, "huber", 0.05),
            "stress": TermSpec(5.0)}


def counts(graphs):
    from xnn.data.datasets import collate
    from xnn.training.losses import local_counts

    return local_counts(collate(graphs)).tolist()


def trainer(model, reducer=None, predictor=None):
    from xnn.training.trainer import Trainer

    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
    return Trainer(model, specs(), opt, reducer=reducer, dtype=torch.float64,
                   predictor=predictor)


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def steps(trainer, batches, counts, metrics=None):
    """Three optimizer steps; ``(first loss, first gradients, last loss, weights)``."""
    losses, first = [], None
    for k, (graphs, c) in enumerate(zip(batches, counts)):
        losses.append(trainer.train_step(graphs, k, metrics, counts=c))
        if first is None:
            first = grads(trainer.model).clone()
    return losses, first, weights(trainer.model)


#: the small SchNet of the ``xnn train`` committee tests
SMALL_SCHNET = ("model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 2, "
                "num_basis: 8}")


def train_small(out, data, *extra):
    """``xnn train`` of :data:`SMALL_SCHNET` (cutoff 3 Å, fp64, CPU) on ``data/train.xyz``,
    validated on ``data/val.xyz``, into ``out``: 3 steps of batches of 3, unshuffled, with a
    stress loss, unless ``extra`` (``key=value``, later wins) says otherwise."""
    from xnn.app.train import train
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig

    cfg = load_config(TrainConfig, None, [
        f"data.datasets.0.path={data / 'train.xyz'}", f"data.val.0.path={data / 'val.xyz'}",
        f"output_dir={out}", "data.batch_size=3", "data.shuffle=false", "model.cutoff=3.0",
        SMALL_SCHNET, "max_steps=3", "precision=fp64", "logging.progress_bar=false",
        "device=cpu", "loss.stress.weight=1.0", *extra])
    return train(cfg)

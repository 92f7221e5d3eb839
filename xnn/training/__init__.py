"""Training as a library: losses, metrics, EMA, schedules, checkpoints, the Trainer and the
epoch loop, taking plain objects (a model, datasets, a reducer, :class:`LoopSettings`).

Written for one process; data parallelism comes from a reducer passed in from outside
(:mod:`xnn.distributed.ddp`). Nothing here imports ``torch.distributed`` or the config: a
run from a config is the application's (:func:`xnn.app.train.train`, ``xnn train``).
"""

from xnn.training.losses import TermSpec, loss_terms, residuals
from xnn.training.metrics import MetricSums
from xnn.training.trainer import NonFiniteLossError, Trainer

__all__ = ["TermSpec", "loss_terms", "residuals", "MetricSums", "Trainer", "NonFiniteLossError",
           "evaluate_model"]


def __getattr__(name):  # heavier entry points are imported lazily
    if name == "evaluate_model":
        from xnn.training.evaluate import evaluate_model

        return evaluate_model
    raise AttributeError(f"module 'xnn.training' has no attribute {name!r}")

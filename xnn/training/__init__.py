"""Training: losses, metrics, EMA, schedules, checkpoints, the loop, and ``train(config)``.

Written for one process; data parallelism comes from a reducer passed in from outside
(:mod:`xnn.distributed.ddp`). Nothing here imports ``torch.distributed``.
"""

from xnn.training.losses import TermSpec, loss_terms, residuals
from xnn.training.metrics import MetricSums
from xnn.training.trainer import NonFiniteLossError, Trainer

__all__ = ["TermSpec", "loss_terms", "residuals", "MetricSums", "Trainer", "NonFiniteLossError",
           "train", "demo_train", "evaluate_model"]


def __getattr__(name):  # heavier entry points are imported lazily
    if name == "train":
        from xnn.training.run import train

        return train
    if name == "demo_train":
        from xnn.training.demo import demo_train

        return demo_train
    if name == "evaluate_model":
        from xnn.training.evaluate import evaluate_model

        return evaluate_model
    raise AttributeError(f"module 'xnn.training' has no attribute {name!r}")

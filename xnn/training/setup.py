"""Device, precision and pretrained weights of a training run (plain arguments)."""

from __future__ import annotations

import torch
from torch import nn

from xnn._files import require_file
from xnn.errors import InputError
from xnn.models.registry import rebuild

PRECISION_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16_mixed": torch.float32,
                    "fp64": torch.float64}


def configure_precision(precision: str) -> tuple[torch.dtype, torch.dtype | None]:
    """``(parameter dtype, autocast dtype or None)``; ``tf32`` enables TF32 matmuls."""
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    autocast = torch.bfloat16 if precision == "bf16_mixed" else None
    return PRECISION_DTYPES[precision], autocast


#: ``pretrained=`` values starting so are SevenNet checkpoint names (``7net-0``): models
#: shipped in the ``sevenn`` wheel, loaded offline and without trust
SEVENN_NAME_PREFIX = "7net"


def is_pretrained_name(path: str) -> bool:
    """Whether ``pretrained=path`` names a shipped SevenNet model rather than a file."""
    import os

    return str(path).startswith(SEVENN_NAME_PREFIX) and not os.path.exists(path)


def load_pretrained(path: str, trust: bool = False) -> nn.Module:
    """The model (architecture and weights) of a model file, a training checkpoint, a
    SevenNet model shipped in the ``sevenn`` wheel by name (``7net-0``), or a mace-torch
    ``.model`` file.

    Both are read as data (``weights_only=True``): no code from the file runs, and its
    hyperparameters cannot ask for trust or name a file to load unless the caller passes
    ``trust`` (:mod:`xnn.models.trust`). A checkpoint gives its EMA weights when it has them.
    The run fine-tunes this model; the ``model`` section of the config must agree with it
    (:func:`check_pretrained_config`). A mace-torch ``.model`` file is a pickle: it loads
    only with the caller's trust (``trust``, or ``model.trust_file=true`` around the call:
    :mod:`xnn.models.trust`); SevenNet names need none.

    Raises:
        InputError: the file does not exist.
        ModelFileError: it is neither an xnn model file nor a training checkpoint, or it asks
            for trust the caller did not give.
    """

    from xnn.errors import ModelFileError, TrustError
    from xnn.models.serialization import load_model
    from xnn.training.checkpoint import load_checkpoint, require_fields

    if is_pretrained_name(path):
        from xnn.models.external.sevenn import SevenNetWrapper

        return SevenNetWrapper(path).train()
    require_file(path, "pretrained=", InputError, suggest=("model.pt",))
    if str(path).endswith(".model"):
        from xnn.models.external.mace import MACEWrapper

        return MACEWrapper(path, trust=trust).train()
    try:
        payload = load_checkpoint(path)
    except ModelFileError:
        try:
            return load_model(path, trust=trust).train()
        except TrustError:
            raise
        except ModelFileError as err:
            raise ModelFileError(f"pretrained={path!r} is neither an xnn model file nor an "
                                 f"xnn training checkpoint ({err})") from None
    require_fields(payload, path, keys=("model",))
    model = rebuild(payload["model"]["name"], payload["model"]["hparams"], path, trust)
    state = dict(payload["model"]["state_dict"])
    if payload.get("ema") is not None:
        state.update(payload["ema"]["shadow"])
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:  # weights of another architecture than its hyperparameters'
        first = " ".join(str(err).split())[:300]
        raise ModelFileError(f"pretrained={path!r}: its weights do not fit the model its "
                             f"hyperparameters describe ({first}); the checkpoint is "
                             "inconsistent: use the run's model.pt or another checkpoint"
                             ) from None
    return model

"""cuEquivariance kernels for the equivariant operations of :mod:`xnn.models.equivariant_ops`.

The ``cueq`` kernel backend evaluates the same maps as the reference (einsum) path, with
the same parameters: every operation is written as a ``cue.SegmentedTensorProduct`` whose
path coefficients are xnn's own couplings (``_cg`` divided by the path fan-in, in e3nn's
real basis), so there is no change of basis, of component order or of normalisation
between the two backends, and a model trained with one runs with the other.

Layout: cuEquivariance operands are flat vectors in ``ir_mul`` order, i.e. xnn's features
``x [n, C, D]`` transposed to ``[n, D, C]``: the block of degree ``l`` is then the contiguous
segment ``[2l+1, C]`` (mode ``iu``). Per-path weights ``w [.., C, P]`` become ``[.., P, C]``.

The compiled kernels (``uniform_1d``) come from ``cuequivariance-ops-torch-cu12`` on CUDA;
without them (and always on CPU) cuEquivariance's pure-PyTorch ``naive`` method runs.

The cuEquivariance modules hold their coefficients as buffers; they are kept out of the
owning module's ``state_dict`` (built lazily per device and dtype), so that switching the
backend never changes the parameter names.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from xnn.errors import InputError

BACKENDS = ("reference", "cueq", "triton")
PIP_PACKAGE = "cuequivariance-torch"


def check_backend(backend: str) -> str:
    """Validate a kernel backend name; ``cueq`` needs cuequivariance installed, ``triton``
    (fused kernels of the edge tensor product, :mod:`xnn.models.triton_tp`) the ``triton``
    package and torch >= 2.6 (``torch.library.triton_op``).

    Raises:
        InputError: unknown name, ``cueq`` without the cuequivariance packages, or
            ``triton`` without triton.
    """
    if backend not in BACKENDS:
        raise InputError(f"model.kernel_backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "cueq":
        try:
            import cuequivariance  # noqa: F401
            import cuequivariance_torch  # noqa: F401
        except ImportError:
            raise InputError(f"model.kernel_backend=cueq needs cuEquivariance: pip install "
                             f"{PIP_PACKAGE} (or set model.kernel_backend=reference)") from None
    if backend == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise InputError("model.kernel_backend=triton needs Triton: pip install triton (CUDA "
                             "builds of torch include it; or set model.kernel_backend=reference)"
                             ) from None
        if not hasattr(torch.library, "triton_op"):
            raise InputError(f"model.kernel_backend=triton needs torch >= 2.6 "
                             f"(torch.library.triton_op), this is {torch.__version__}")
    return backend


def _stp(subscripts: str):
    import cuequivariance as cue

    return cue.SegmentedTensorProduct.from_subscripts(subscripts)


def edge_tp_descriptor(paths: list[tuple[int, int, int]], coeffs: list[np.ndarray], l_in: int,
                       l_sh: int, l_out: int, channels: int):
    """``m[ku] = Σ_p w_p[u] c_p[ijk] x[iu] y[j]`` (``u,iu,j,ku+ijk``).

    Args:
        paths: ``(l1, l2, l3)`` in the order of the weights.
        coeffs: per path, ``[2l1+1, 2l2+1, 2l3+1]`` coefficients.
    """
    d = _stp("u,iu,j,ku+ijk")
    s_x = [d.add_segment(1, (2 * l + 1, channels)) for l in range(l_in + 1)]
    s_y = [d.add_segment(2, (2 * l + 1,)) for l in range(l_sh + 1)]
    s_o = [d.add_segment(3, (2 * l + 1, channels)) for l in range(l_out + 1)]
    for (l1, l2, l3), c in zip(paths, coeffs):
        d.add_path(None, s_x[l1], s_y[l2], s_o[l3], c=c)
    return d


def contraction_descriptor(paths: list[tuple[int, int, int]], coeffs: list[np.ndarray],
                           l_max: int, l3_max: int, channels: int):
    """One step of the product basis, ``b'[ku] = Σ_p w_p[u] c_p[ijk] b[iu] a[ju]``
    (``u,iu,ju,ku+ijk``)."""
    d = _stp("u,iu,ju,ku+ijk")
    s_b = [d.add_segment(1, (2 * l + 1, channels)) for l in range(l_max + 1)]
    s_a = [d.add_segment(2, (2 * l + 1, channels)) for l in range(l_max + 1)]
    s_o = [d.add_segment(3, (2 * l + 1, channels)) for l in range(l3_max + 1)]
    for (l1, l2, l3), c in zip(paths, coeffs):
        d.add_path(None, s_b[l1], s_a[l2], s_o[l3], c=c)
    return d


def linear_descriptor(c_out: int, l_max: int, norm: float, c_in: int):
    """``out[iv] = norm Σ_u W_l[uv] x[iu]`` per degree (``uv,iu,iv``)."""
    d = _stp("uv,iu,iv")
    for l in range(l_max + 1):
        s_x = d.add_segment(1, (2 * l + 1, c_in))
        s_o = d.add_segment(2, (2 * l + 1, c_out))
        d.add_path(None, s_x, s_o, c=norm)
    return d


class CueOp:
    """A cuEquivariance polynomial, built lazily per device, dtype and width; not a submodule, so
    its coefficient buffers stay out of the owner's ``state_dict``.

    Args:
        make_descriptor: ``make_descriptor(channels)`` returns the
            ``cue.SegmentedTensorProduct`` (last operand = output) for ``channels`` input
            channels.
        cuda_method: cuEquivariance's kernel on CUDA (``uniform_1d``: the tensor product and
            the product basis, one uniform channel mode; ``fused_tp``: the linear maps);
            where it is missing or refuses the polynomial, the ``naive`` method.
    """

    def __init__(self, make_descriptor: Callable[[int], object], cuda_method: str = "uniform_1d"):
        self.make_descriptor, self.cuda_method = make_descriptor, cuda_method
        self.cache: dict[tuple[torch.device, torch.dtype, int], torch.nn.Module] = {}

    def module(self, device: torch.device, dtype: torch.dtype, channels: int) -> torch.nn.Module:
        key = (device, dtype, channels)
        if key not in self.cache:
            import cuequivariance as cue
            import cuequivariance_torch as cuet

            poly = cue.SegmentedPolynomial.eval_last_operand(self.make_descriptor(channels))
            module = None
            if device.type == "cuda" and importlib.util.find_spec("cuequivariance_ops_torch"):
                try:  # the CUDA kernel (cuequivariance-ops-torch-cu12); refused at construction
                    module = cuet.SegmentedPolynomial(poly, method=self.cuda_method,
                                                      math_dtype=dtype)
                except (ImportError, ValueError, AssertionError, NotImplementedError,
                        RuntimeError):
                    module = None
            if module is None:
                module = cuet.SegmentedPolynomial(poly, method="naive", math_dtype=dtype)
            self.cache[key] = module.to(device)
        return self.cache[key]

    def __call__(self, inputs: list[Tensor], channels: int,
                 input_indices: dict[int, Tensor] | None = None) -> Tensor:
        """Evaluate on flat operands ``inputs`` (batch first); returns the flat output."""
        x = inputs[-1]
        [out] = self.module(x.device, x.dtype, channels)(inputs, input_indices=input_indices)
        return out

    def __getstate__(self):  # pickling / deepcopy: rebuild the kernels where they are used
        return {"make_descriptor": self.make_descriptor, "cuda_method": self.cuda_method,
                "cache": {}}


def to_ir_mul(x: Tensor) -> Tensor:
    """``[n, C, D]`` -> flat ``ir_mul`` ``[n, D*C]``."""
    return x.transpose(1, 2).reshape(x.shape[0], -1)


def from_ir_mul(x: Tensor, channels: int) -> Tensor:
    """Flat ``ir_mul`` ``[n, D*C]`` -> ``[n, C, D]``."""
    return x.view(x.shape[0], -1, channels).transpose(1, 2)


def set_kernel_backend(model: torch.nn.Module, backend: str, name: str = "") -> None:
    """Switch the kernel backend of every native module of ``model`` that has one (the
    equivariant model, also as a term of a sum), recorded in its ``hparams``.

    Raises:
        InputError: unknown backend, ``cueq`` without cuequivariance, ``triton`` without
            triton, or a backend other than ``reference`` for a model without kernel backends.
    """
    check_backend(backend)
    targets = [m for m in model.modules()
               if isinstance(getattr(m, "hparams", None), dict) and "backend" in m.hparams
               and hasattr(m, "set_backend")]
    if not targets and backend != "reference":
        raise InputError(f"model {name or type(model).__name__!r} has no kernel backends "
                         f"(only equivariant has; mace: build('mace', ..., backend=...)); "
                         f"set model.kernel_backend=reference")
    for m in targets:
        m.set_backend(backend)

"""The ``model`` section shared by ``xnn train``, ``xnn md``, ``xnn relax`` and ``xnn run``.

One dataclass, one spelling for every command: the model is ``file`` (a model file) or
``name`` (a registry model, ``xnn.models.available_models()``) built with a typed ``cutoff``
and ``species`` and its other ``hyperparameters``; a sum of terms is the registry's own
``name: sum`` with ``hyperparameters.terms`` (each ``{name: ..., ...}`` or
``{model_file: PATH}``); ``kernel_backend`` picks the tensor-product kernels; ``trust_file``
is the caller's trust in the files the section names.

Some keys belong to one kind of command and are refused by the other with one line:

- training only (:meth:`ModelConfig.check_train`): ``e0``, ``scale_shift``,
  ``activation_checkpointing`` -- how a new model is fitted;
- runs only (:meth:`ModelConfig.check_run`, ``xnn md`` / ``relax`` / ``run``): ``dtype``,
  ``device``, ``compile``, ``skin``, ``neighbor_backend``, ``head`` -- how a model is
  evaluated along a trajectory (training sets ``precision``, ``device`` and ``compile`` at
  its top level, and builds its neighbor lists once per structure).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from xnn.config.loader import ConfigError, check_range, field

#: kernel backends of ``model.kernel_backend`` (``saved``: as in the model file)
KERNEL_BACKENDS = ("saved", "reference", "cueq", "triton")

#: keys of the model section that only ``xnn train`` uses -> their default
TRAIN_ONLY = {"e0": "fit", "scale_shift": True, "activation_checkpointing": False}
#: keys that only the runs (md, relax, run) use -> their default
RUN_ONLY = {"dtype": "float64", "device": "auto", "compile": False, "skin": 1.0,
            "neighbor_backend": "auto", "head": None}
#: named conventions of ``model.e0`` (or a ``{element: eV}`` map); ``average`` is MACE's name
#: of ``fit`` (the same least squares, the same numbers)
E0_CHOICES = ("fit", "average", "zero", "isolated")
#: typed keys that must not be repeated in ``model.hyperparameters``
TYPED = ("cutoff", "species", "kernel_backend", "activation_checkpointing")


@dataclass
class ModelConfig:
    """The ``model`` section (see the module docstring for which command uses which key)."""

    file: str | None = field(None, "model file written by xnn train / xnn.save_model (md, "
                             "relax, run; xnn train starts from a file through its own "
                             "top-level key, pretrained)")
    name: str | None = field(None, "registry name of a built-in model "
                             "(xnn.models.available_models()); sum: the sum of "
                             "hyperparameters.terms, e.g. [{name: d3, functional: pbe, "
                             "trainable: false}, {name: schnet}] or [{model_file: model.pt}, "
                             "{name: d3, functional: pbe}] (a term may be {model_file: PATH}; "
                             "trainable: false freezes a term in training)")
    cutoff: float | None = field(None, "interaction cutoff (Å) of the model built from name; "
                                 "xnn train: also the cutoff of the data's neighbor lists "
                                 "(sum: the largest term cutoff allowed, and the cutoff of "
                                 "the terms that set none); null: the model's default")
    species: list[Any] | None = field(None, "elements the model knows (symbols or atomic "
                                      "numbers); xnn train: null = those of the training data")
    hyperparameters: dict[str, Any] = field({}, "other keyword arguments of the model "
                                            "(validated by xnn.models.build)")
    kernel_backend: str = field("saved", "kernels of the equivariant model's tensor products, "
                                "product basis and linear maps: saved (as in the model file; "
                                "a new model: reference), reference (einsum), cueq "
                                "(cuEquivariance: pip install cuequivariance-torch) or triton "
                                "(fused Triton kernels of the edge tensor product on CUDA: "
                                "pip install triton); same parameters and results to "
                                "rounding, saved with a trained model",
                                choices=KERNEL_BACKENDS)
    trust_file: bool = field(False, "trust the model files this config names (model.file, "
                             "xnn train's pretrained, model_file terms of a sum, a MACE .model or "
                             "SevenNet checkpoint in model.hyperparameters): they may "
                             "unpickle what they hold or name, which can run code; only for "
                             "files you trust (a file never grants trust by itself)")
    e0: Any = field("fit", "xnn train only: per-element reference energies E0: fit "
                    "(least squares of the training energies on composition), average "
                    "(MACE's name of fit: the same numbers), zero, isolated (the energy labels "
                    "of the training files' one-atom entries with config_type=IsolatedAtom, "
                    "as MACE; those entries are then left out of training) or a map "
                    "{element: eV}, e.g. {Cu: -0.0052, Au: -0.0031} (symbols or atomic "
                    "numbers, covering every species of the model); recorded in the model "
                    "file (e0, e0_convention)")
    scale_shift: bool = field(True, "xnn train only: set the output scale to the force RMS "
                              "and the shift to the mean per-atom residual energy (energy "
                              "minus E0s, per atom) of the training set, as MACE's "
                              "rms_forces_scaling (its default); false: scale 1, shift 0 "
                              "(MACE's no_scaling)")
    activation_checkpointing: bool = field(False, "xnn train only: recompute each interaction "
                                           "block in backward instead of keeping its "
                                           "intermediates (schnet, painn, equivariant; exact, "
                                           "also for force training; ~2x step time, "
                                           "several-fold less activation memory); saved with "
                                           "the model, no effect in evaluation or MD")
    dtype: str = field("float64", "md/relax/run only: floating-point precision of the "
                       "simulation", choices=("float64", "float32"))
    device: str = field("auto", "md/relax/run only: cpu, cuda, cuda:N, or auto (cuda when "
                        "available)")
    compile: bool = field(False, "md/relax/run only: torch.compile the model's hot path where "
                          "it has one (the equivariant model on a GPU, after a first step that "
                          "compiles; figures: benchmarks/results/README.md, Models)")
    skin: float = field(1.0, "md/relax/run only: Verlet skin (Å): neighbor lists are rebuilt "
                        "after a move of skin/2")
    neighbor_backend: str = field("auto", "md/relax/run only: neighbor-list backend",
                                  choices=("auto", "torch", "vesin", "brute"))
    head: str | None = field(None, "md/relax/run only: the head of a multi-head model (xnn "
                             "train finetune.heads=true) that predicts (null: its first, the "
                             "new data's); an unknown name lists the model's heads")

    def __post_init__(self):
        self.e0_table()  # refuses an invalid model.e0 with one line
        check_range("model.cutoff", self.cutoff, 0.0, low_inclusive=False)
        check_range("model.skin", self.skin, 0.0)
        for key in TYPED:
            if key in self.hyperparameters:
                raise ConfigError(f"set model.{key}, not model.hyperparameters.{key}")

    def e0_table(self) -> dict[int, float] | None:
        """The ``{atomic number: eV}`` map of ``model.e0`` given as a map, ``None`` for a
        named convention (:data:`E0_CHOICES`).

        Raises:
            ConfigError: an unknown name, an unknown element, a repeated element or a value
                that is not a finite number (one line naming the entry).
        """
        e0 = self.e0
        if isinstance(e0, str):
            if e0 not in E0_CHOICES:
                raise ConfigError(f"model.e0={e0!r} is not a valid choice; choose one of "
                                  f"{list(E0_CHOICES)} or give a map {{element: eV}}, e.g. "
                                  "model.e0='{Cu: -0.0052, Au: -0.0031}'")
            return None
        if not isinstance(e0, Mapping) or not e0:
            raise ConfigError(f"model.e0={e0!r}: give one of {list(E0_CHOICES)} or a "
                              "non-empty map {element: eV}, e.g. {Cu: -0.0052, Au: -0.0031}")
        table: dict[int, float] = {}
        for key, value in e0.items():
            z = _atomic_number(key)
            if z is None:
                raise ConfigError(f"model.e0.{key}: not an element (give a chemical symbol "
                                  "such as Cu or an atomic number such as 29)")
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not math.isfinite(value):
                raise ConfigError(f"model.e0.{key}={value!r} is not a finite number (eV)")
            if z in table:
                raise ConfigError(f"model.e0 gives element {key!r} (Z={z}) twice")
            table[z] = float(value)
        return table

    def e0_convention(self) -> str:
        """The name ``model.e0`` is recorded under: its convention, or ``given`` for a map."""
        return self.e0 if isinstance(self.e0, str) else "given"

    def build_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``xnn.models.build(name, ...)`` for a run: the
        hyperparameters plus ``cutoff`` and ``species`` where set."""
        kwargs = dict(self.hyperparameters)
        if self.name == "sum" and self.cutoff is not None:
            raise ConfigError("model.cutoff with model.name=sum: in xnn md, relax and run "
                              "each term sets its own cutoff (model.hyperparameters.terms)")
        if self.cutoff is not None:
            kwargs["cutoff"] = float(self.cutoff)
        if self.species is not None:
            kwargs["species"] = list(self.species)
        return kwargs

    def check_source(self) -> None:
        """Exactly one of ``file`` and ``name`` must be set (checked when the model is loaded)."""
        if (self.file is None) == (self.name is None):
            raise ConfigError("set exactly one of model.file (a model file) or model.name "
                              "(a built-in model with model.hyperparameters)")
        if self.file is not None:
            for key, value in (("cutoff", self.cutoff), ("species", self.species)):
                if value is not None:
                    raise ConfigError(f"model.{key} is a setting of a model built from "
                                      f"model.name; the model file {self.file!r} keeps its own")
            if self.hyperparameters:
                raise ConfigError("model.hyperparameters are those of a model built from "
                                  f"model.name; the model file {self.file!r} keeps its own")

    def check_train(self) -> None:
        """Refuse, with one line each, the keys ``xnn train`` does not use."""
        _refuse_set(self, RUN_ONLY, "a setting of xnn md, relax and run (xnn train sets "
                    "precision, device and compile at its top level)")
        if self.file is not None:
            raise ConfigError("model.file is for xnn md, relax and run; xnn train builds "
                              "model.name (start from a model file with pretrained=PATH)")
        if self.name is None:
            raise ConfigError("xnn train needs model.name (a registry model, e.g. schnet)")
        if self.hyperparameters.get("backend", self.kernel_backend) != self.kernel_backend:
            raise ConfigError("set model.kernel_backend, not model.hyperparameters.backend")
        if self.cutoff is None:
            raise ConfigError("xnn train needs model.cutoff (Å): the cutoff of the model and "
                              "of the data's neighbor lists")

    def check_run(self) -> None:
        """Refuse, with one line each, the keys the runs (md, relax, run) do not use."""
        _refuse_set(self, TRAIN_ONLY, "a setting of xnn train (fitting a new model); a run "
                    "evaluates the model as it is")


def _atomic_number(key) -> int | None:
    """The atomic number of a symbol (``"Cu"``) or number (``29``, ``"29"``), else None."""
    from ase.data import atomic_numbers

    if isinstance(key, bool):
        return None
    if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
        z = int(key)
        return z if 1 <= z <= 118 else None
    z = atomic_numbers.get(key) if isinstance(key, str) else None
    return z if z else None


def _refuse_set(cfg: ModelConfig, keys: dict, why: str) -> None:
    values = dataclasses.asdict(cfg)
    for key, default in keys.items():
        if values[key] != default:
            raise ConfigError(f"model.{key} is {why}; remove it")


#: the model section of ``xnn train`` (a SchNet of cutoff 5 Å, reference kernels)
def train_model_default() -> ModelConfig:
    return ModelConfig(name="schnet", cutoff=5.0, kernel_backend="reference")


def model_field(default: ModelConfig | None = None, help: str = "the potential: model.file, "  # noqa: A002
                "or model.name and model.hyperparameters"):
    """The ``model`` field of a command's config (``default``: its defaults)."""
    return field(default or ModelConfig(), help)

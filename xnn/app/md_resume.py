"""What a resumed ``xnn md`` / ``xnn relax`` run must share with the run that wrote its
checkpoint, and whether there is anything left to run.

A checkpoint's meta holds ``resume_check``: a fingerprint of the model (a hash of its
registry name, hyperparameters and every parameter and buffer, as :func:`xnn.models.
serialization.model_payload` gives them; the kernel backend, an execution choice with the
same results to rounding, left out), where the model came from (for messages), and the
settings that change the physics (:func:`md_settings`, :func:`relax_settings`), named by
their config keys. A resume whose model or physics differ is refused with one line naming
what differs; the length of the run (``steps``; ``max_steps``, ``fmax``), outputs, safety
checks, the skin and the neighbor-list backend may change. A checkpoint written before
fingerprints existed is resumed with one warning that nothing could be checked.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from xnn.app.md_setup import pressure_to_internal, target_temperatures
from xnn.errors import InputError
from xnn.units import EV_PER_A3_TO_GPA

#: payload entries that describe the file, not the model (the run's dtype is a setting)
_FILE_ENTRIES = ("format", "format_version", "xnn_version", "dtype")
#: hyperparameters that choose how the model runs, with the same results to rounding
_EXECUTION_ENTRIES = ("backend",)
#: the thermostat and barostat keys each ensemble integrates with
_ENSEMBLE_KEYS = {
    "nve": (),
    "langevin": ("thermostat.friction",),
    "csvr": ("thermostat.tau",),
    "nhc": ("thermostat.tau", "thermostat.chain_length"),
    "npt": ("thermostat.tau", "barostat.tau_p", "barostat.compressibility",
            "barostat.anisotropic"),
}


def model_fingerprint(model: nn.Module) -> str:
    """16 hex digits of a SHA-256 over what defines the model's energies: its registry name,
    hyperparameters, species, reference energies and every parameter and buffer (floats
    hashed as float64). Models that cannot be stored as data (a MACE wrapper from a pickled
    file) are hashed by their classes, cutoff and state dict."""
    from xnn.models.serialization import model_payload

    try:
        payload = model_payload(model)
    except Exception:  # noqa: BLE001 - not storable as data: hash what defines it anyway
        payload = {"classes": [f"{type(m).__module__}.{type(m).__qualname__}"
                               for m in model.modules()],
                   "cutoff": float(model.cutoff), "state_dict": model.state_dict()}
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in payload.items() if k not in _FILE_ENTRIES})
    return h.hexdigest()[:16]


def _feed(h, value) -> None:
    """Add ``value`` (nested dicts, lists, tensors, primitives) to the hash ``h``, keys in
    sorted order, with type tags (``1`` and ``1.0`` and ``"1"`` differ)."""
    if isinstance(value, Mapping):
        h.update(b"{")
        for k in sorted(value, key=repr):
            if k in _EXECUTION_ENTRIES:
                continue
            h.update(repr(k).encode() + b":")
            _feed(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for v in value:
            _feed(h, v)
        h.update(b"]")
    elif isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        t = t.to(torch.float64) if t.is_floating_point() else t
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.contiguous().numpy().tobytes())
    else:
        h.update(f"{type(value).__name__}:{value!r}".encode())


def model_source(cfg) -> str:
    """Where the run's model comes from, for messages (``model.file=...`` or
    ``model.name=...``, a sum with the names of its terms)."""
    m = cfg.model
    src = f"model.file={m.file}" if m.file is not None else f"model.name={m.name}"
    terms = m.hyperparameters.get("terms") if m.name == "sum" else None
    if isinstance(terms, (list, tuple)):
        names = [t.get("name", t.get("model_file", "?")) if isinstance(t, Mapping) else "?"
                 for t in terms]
        src += f" of terms {names}"
    return src


def md_settings(cfg, n_systems: int) -> dict:
    """The settings of an ``xnn md`` run that change its physics, by config key: ensemble,
    timestep, dtype, and the ensemble's targets and coupling constants (per-system target
    temperatures resolved; pressure in GPa)."""
    out = {"ensemble": cfg.ensemble, "timestep": float(cfg.timestep),
           "model.dtype": cfg.model.dtype}
    if cfg.ensemble != "nve":
        temps = target_temperatures(cfg, n_systems, torch.zeros(1, dtype=torch.float64))
        out["temperature"] = [float(t) for t in temps]
    if cfg.ensemble == "npt":
        out["pressure_GPa"] = pressure_to_internal(cfg.pressure, cfg.pressure_unit) \
            * EV_PER_A3_TO_GPA
    th, ba = cfg.thermostat, cfg.barostat
    values = {"thermostat.tau": th.tau, "thermostat.friction": th.friction,
              "thermostat.chain_length": th.chain_length, "barostat.tau_p": ba.tau_p,
              "barostat.compressibility": ba.compressibility,
              "barostat.anisotropic": ba.anisotropic}
    out.update({k: values[k] for k in _ENSEMBLE_KEYS[cfg.ensemble]})
    return out


def relax_settings(cfg) -> dict:
    """The settings of an ``xnn relax`` run that change the path of its relaxation."""
    return {"relax_cell": cfg.relax_cell, "maxstep": float(cfg.maxstep),
            "model.dtype": cfg.model.dtype,
            "pressure_GPa": pressure_to_internal(cfg.pressure, cfg.pressure_unit)
            * EV_PER_A3_TO_GPA}


def resume_identity(cfg, model: nn.Module, settings: dict) -> dict:
    """The ``resume_check`` entry of a checkpoint's meta for this run."""
    return {"model": model_fingerprint(model), "model_source": model_source(cfg),
            "settings": settings}


def check_resume(cfg, meta: dict, identity: dict, command: str) -> None:
    """Refuse to resume ``meta``'s run with another model or other physics (one line naming
    every difference); warn once for a checkpoint written before fingerprints existed.

    Raises:
        InputError: the model or a setting of :func:`md_settings` / :func:`relax_settings`
            differs from the run that wrote the checkpoint.
    """
    then = meta.get("resume_check")
    if then is None:
        warnings.warn(f"checkpoint {cfg.resume} was written by an xnn {command} without a "
                      "model fingerprint: the model and settings cannot be checked against "
                      "it; make sure they are the run's own", stacklevel=2)
        return
    now, old = identity["settings"], then["settings"]
    diff = [f"{k}={old[k]!r} (now {now[k]!r})" for k in now if k in old and old[k] != now[k]]
    if then["model"] != identity["model"] and old.get("model.dtype") == now["model.dtype"]:
        diff.insert(0, _model_difference(then, identity))
    if diff:
        raise InputError(f"checkpoint {cfg.resume} was written with {'; '.join(diff)}: resume "
                         f"with the model and settings of that run (only the run length, "
                         f"outputs and safety checks may change), or start a new xnn "
                         f"{command} from its last frame")


def _model_difference(then: dict, now: dict) -> str:
    """``another model (...)``: the checkpoint's model and this run's, by source and
    fingerprint."""
    old_src, new_src = then.get("model_source", "?"), now["model_source"]
    new = ("the same source with other weights or hyperparameters" if old_src == new_src
           else new_src)
    return (f"another model ({old_src}, fingerprint {then['model']}; now {new}, fingerprint "
            f"{now['model']})")

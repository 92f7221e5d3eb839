"""The application behind ``xnn lammps IN.lammps --model FILE``: a LAMMPS input run with an xnn
model as its force field, on one or many MPI ranks (``mpirun -np N xnn lammps ...``).

The input holds everything but the force field (no ``pair_style``): units metal, the box,
atoms, masses, fixes, computes, thermo, dumps, restarts. The command runs the input's
commands up to its first ``run``/``minimize``/``rerun``, then adds the force field as
:class:`~xnn.interop.lammps.XnnFixExternal` (the model's cutoff, the ghost cutoff of the
decomposition, the units check, LAMMPS types to elements), then runs the rest. An error of
the model (in LAMMPS's callback) ends the command with its one line.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from xnn.errors import InputError

#: the commands before which the force field must exist
FIRST_FORCE = ("run", "minimize", "rerun")
#: the force field is xnn's: an input that sets its own is refused
REFUSED = ("pair_style", "pair_coeff", "kspace_style")


@dataclass
class LammpsOptions:
    """``xnn lammps``'s options (see ``xnn lammps --help``)."""

    input: str
    model: str
    elements: list[str] = field(default_factory=list)
    device: str = "cpu"
    dtype: str = "float64"
    mode: str = "spatial"
    skin: float | None = None
    variables: list[tuple[str, str]] = field(default_factory=list)
    log: str = "log.lammps"
    screen: bool = True
    trust_file: bool = False


def split_input(text: str) -> tuple[str, str]:
    """``(before, rest)``: the input up to (not including) its first command of
    :data:`FIRST_FORCE`, and from there on (``&`` continuations and comments respected).

    Raises:
        InputError: the input sets a force field of its own, or never runs.
    """
    lines = text.splitlines(keepends=True)
    k, at = 0, None
    while k < len(lines):
        start, joined = k, ""
        while True:
            body = lines[k].split("#", 1)[0].rstrip()
            k += 1
            if body.endswith("&") and k < len(lines):
                joined += body[:-1] + " "
                continue
            joined += body
            break
        words = joined.split()
        if not words:
            continue
        if words[0] in REFUSED:
            raise InputError(f"the input sets `{words[0]}` (line {start + 1}): xnn lammps adds "
                             "the force field itself; remove the pair_style/pair_coeff lines")
        if words[0] in FIRST_FORCE and at is None:
            at = start
    if at is None:
        raise InputError("the input has no run, minimize or rerun command: nothing would use "
                         "the model")
    return "".join(lines[:at]), "".join(lines[at:])


def _elements(opts: LammpsOptions, model, n_types: int) -> list:
    """LAMMPS types 1..n to elements: ``--elements`` or the model's species in order."""
    if opts.elements:
        return list(opts.elements)
    species = model.species
    if species is None or len(species) != n_types:
        known = "any element" if species is None else f"{len(species)} elements"
        raise InputError(f"the input has {n_types} atom types and the model knows {known}: "
                         "give --elements, one per LAMMPS type in order (like pair_coeff "
                         "* * Cu O)")
    return list(species)


def run_lammps(opts: LammpsOptions) -> dict:
    """Run ``opts.input`` with the model as the force field (collective over MPI ranks).

    Returns:
        ``{"ranks": N, "rank": this one, "ghost_cutoff": Å, "mode": ..., "energy": eV}``
        (of the last evaluation).
    """
    import torch

    from xnn.interop import load_xnn_model
    from xnn.interop.lammps import XnnFixExternal, require_lammps

    path = Path(opts.input)
    if not path.is_file():
        raise InputError(f"LAMMPS input {opts.input!r} does not exist")
    before, rest = split_input(path.read_text())
    dtype = {"float64": torch.float64, "float32": torch.float32}.get(opts.dtype)
    if dtype is None:
        raise InputError(f"--dtype must be float64 or float32, got {opts.dtype!r}")
    model = load_xnn_model(opts.model, opts.trust_file)
    comm = _world()
    lammps = require_lammps()
    args = ["-log", opts.log, "-nocite"] + ([] if opts.screen else ["-screen", "none"])
    for name, value in opts.variables:
        args += ["-var", name, value]
    lmp = lammps.lammps(cmdargs=args) if comm is None else lammps.lammps(comm=comm,
                                                                         cmdargs=args)
    try:
        with tempfile.TemporaryDirectory(prefix="xnn-lammps-") as tmp:
            # each part runs from the input's folder (read_data, include, dumps are relative)
            parts = [Path(tmp) / "before.in", Path(tmp) / "rest.in"]
            for p, text in zip(parts, (before, rest)):
                p.write_text(text)
            _file(lmp, parts[0], path)
            fix = XnnFixExternal(lmp, model, _elements(opts, model,
                                                       int(lmp.extract_setting("ntypes"))),
                                 device=opts.device, dtype=dtype, skin=opts.skin,
                                 mode=opts.mode, trust=opts.trust_file)
            try:
                _file(lmp, parts[1], path)
            finally:
                if fix.error is not None:
                    raise fix.error
        return {"ranks": fix.ranks, "rank": int(lmp.extract_setting("world_rank")),
                "ghost_cutoff": fix.ghost_cutoff,
                "mode": fix.mode, "energy": fix.energy}
    finally:
        lmp.close()


def _file(lmp, part: Path, source: Path) -> None:
    """``lmp.file(part)`` from ``source``'s folder; a LAMMPS error becomes one line."""
    import os

    here = os.getcwd()
    os.chdir(source.resolve().parent)
    try:
        lmp.file(str(part))
    except Exception as err:  # LAMMPS's own errors (MPIAbort-free: the library raises)
        message = re.sub(r"\s+", " ", str(err)).strip()
        raise InputError(f"LAMMPS ({source.name}): {message}") from None
    finally:
        os.chdir(here)


def _world():
    """``MPI.COMM_WORLD`` when mpi4py is there (LAMMPS then shares it), else ``None``."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD

"""The application behind ``xnn export``: a model file written as a torch-only artefact
(:func:`xnn.models.serialization.export_model`; the contract of its inputs is
:mod:`xnn.models.export`), or as the object LAMMPS's ``pair_style mliap unified FILE 0``
loads (format ``lammps-mliap``, :func:`xnn.interop.mliap.export_mliap`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: file suffix of each format
SUFFIX = {"export": ".pt2", "aoti": ".pt2", "torchscript": ".pt", "lammps-mliap": ".pt"}
#: how each format loads with torch alone (``FILE``: the artefact's path)
LOADER = {
    "export": "torch.export.load(FILE).module()",
    "aoti": "torch._inductor.aoti_load_package(FILE)",
    "torchscript": "torch.jit.load(FILE)",
    "lammps-mliap": "LAMMPS (ML-IAP, PYTHON and KOKKOS; docs/lammps-mliap.md)",
}


@dataclass
class Exported:
    """An artefact written by :func:`export_file`."""

    path: Path
    format: str
    cutoff: float
    #: input lines of a LAMMPS host (format ``lammps-mliap``)
    lines: tuple[str, ...] = ()

    def loader(self) -> str:
        """The torch call that loads it (``lammps-mliap``: LAMMPS's input lines)."""
        if self.lines:
            return f"{LOADER[self.format]}: {'; '.join(self.lines)}"
        return LOADER[self.format].replace("FILE", repr(str(self.path)))


def default_out(model: str, format: str) -> Path:  # noqa: A002
    """``MODEL`` with the suffix ``.<format><SUFFIX>`` (``model.export.pt2``)."""
    src = Path(model)
    return src.with_name(f"{src.stem}.{format}{SUFFIX[format]}")


def export_file(model: str, out: str | None = None, format: str = "export",  # noqa: A002
                dtype: str | None = None, trust_file: bool = False,
                elements: list[str] | None = None, mode: str = "spatial",
                device: str | None = None) -> Exported:
    """Write the model file ``model`` as ``format`` to ``out`` (``None``:
    :func:`default_out`), in ``dtype`` (``None``: the model's); the output path is checked
    before any work.

    ``elements`` (LAMMPS type names, default the model's species in order), ``mode`` and
    ``device`` are the ``lammps-mliap`` format's (:class:`xnn.interop.mliap.XnnMLIAPUnified`);
    other formats refuse them.

    Raises:
        InputError, ModelFileError: one line.
    """
    import torch

    from xnn._files import check_output_file
    from xnn.errors import InputError
    from xnn.models.serialization import export_model, load_model

    mliap = format == "lammps-mliap"
    if not mliap and (elements or device is not None or mode != "spatial"):
        raise InputError(f"--elements, --mode and --device are options of --format "
                         f"lammps-mliap, not of --format {format}")
    path = Path(out) if out else default_out(model, format)
    check_output_file(path, "--out", example=f"model{SUFFIX[format]}")
    loaded = load_model(model, trust=trust_file)
    if dtype is not None:
        loaded = loaded.to(getattr(torch, dtype))
    if mliap:
        from xnn.interop.mliap import export_mliap

        unified = export_mliap(loaded, path, elements, mode, device)
        return Exported(path, format, float(loaded.cutoff),
                        tuple(unified.lammps_lines(str(path))))
    written = export_model(loaded, path, format=format)
    return Exported(Path(written), format, float(loaded.cutoff))

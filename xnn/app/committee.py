"""The application behind ``xnn committee``: one committee model file from K model files
trained separately (peer models: MACE or SevenNet wrappers, or native xnn models of one
kind), as :class:`~xnn.models.committee.Committee` of the loaded models.

The members are loaded as data (:func:`xnn.load_model`); a member file that would unpickle
(a MACE model saved by an earlier xnn) needs ``trust`` (``--trust-file``), and the committee
file written holds every member as data. Its calibration factors are 1 (``xnn train``
calibrates the committees it trains; ``xnn eval`` reports how far off the spread is on any
data).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from xnn.errors import InputError


@dataclass
class Built:
    """A committee file written by :func:`build_committee`."""

    path: Path
    size: int
    member: str  # registry name of the members
    cutoff: float

    def line(self) -> str:
        return (f"wrote {self.path}: a committee of {self.size} {self.member} members (cutoff "
                f"{self.cutoff:g} Å); its prediction is their mean, forces_std their spread")


def build_committee(files: Sequence[str | os.PathLike], out: str | os.PathLike,
                    trust: bool = False) -> Built:
    """Load the model files ``files`` (K >= 2, one kind, cutoff, species and dtype) and save
    them as one committee model file ``out``.

    Args:
        trust: the caller trusts the member files (they may unpickle: MACE models saved by
            an earlier xnn); the committee file written is data only.
    Raises:
        InputError: fewer than two files, members that differ in kind, cutoff, species or
            dtype, or a member that is itself a committee.
        ModelFileError: a member file that cannot be read (or needs trust not given).
    """
    from xnn._files import check_output_file
    from xnn.models.committee import Committee
    from xnn.models.model_info import dtype_name, model_dtype, registry_name
    from xnn.models.serialization import load_model, save_model

    if len(files) < 2:
        raise InputError(f"xnn committee needs at least 2 model files, got {len(files)}")
    out = check_output_file(out, "--out", example="committee.pt")
    models = [load_model(f, trust=trust) for f in files]
    dtypes = [dtype_name(model_dtype(m)) for m in models]
    if len(set(dtypes)) > 1:
        raise InputError(f"the member files have dtypes {dtypes}: save them in one dtype "
                         "(members run in one dtype)")
    committee = Committee(models)
    path = save_model(committee, out)
    return Built(path, committee.committee_size, registry_name(committee.members[0]),
                 committee.cutoff)

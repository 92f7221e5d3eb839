"""The application behind ``xnn eval``: errors of a model file on labelled data, or of a
training run on one split of its own data.

``xnn eval MODEL DATA`` reads DATA with the given label keys; ``xnn eval --split test RUN``
reads the run's ``split.json`` (written by ``xnn train``: which structures of which file
each split holds, and each file's size and SHA-256) and evaluates ``RUN/model.pt`` on exactly
those structures, refusing a data file that changed since. A model with non-finite weights,
or metrics that come out NaN or infinite, end the command with one line (exit status 2):
a NaN table is not a result.

A committee (:class:`~xnn.models.committee.Committee`) also gets its uncertainty metrics
(:func:`uncertainty_metrics`) and a calibration plot, ``calibration_<data>.png`` next to the
parity plot: the RMS observed error against the RMS predicted std, binned.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from xnn.data.datasets import ConcatDataset, Subset
from xnn.data.inventory import inventory
from xnn.data.label_keys import describe_keys, suggest_key
from xnn.data.sources import read_structures
from xnn.errors import DataFileError, InputError, ModelFileError
from xnn.training.committee import calibrated_rows, committee_size

SPLITS = ("train", "val", "test")
LABEL_FLAGS = {"energy": "--energy-key", "forces": "--forces-key", "stress": "--stress-key",
               "virial": "--stress-key"}


@dataclass
class EvalData:
    """Structures to evaluate: ``dataset``, a ``name`` for titles and file names, and a
    one-line ``description`` of where they come from."""

    dataset: object
    name: str
    description: str


def labelled_data(path: str, keys: dict[str, str], named: tuple[str, ...] = ()) -> EvalData:
    """The structures of ``path`` with labels under ``keys`` (``{energy, forces, stress,
    virial}: key``).

    Args:
        named: the labels whose key the user named (``--energy-key`` ...): each must be
            found in at least one structure.
    Raises:
        DataFileError: no structure carries any of the labels, or none carries a label whose
            key was named; the message lists the keys the file holds and the flags to name
            them.
    """
    ds = read_structures(path, 1.0, keys["energy"], keys["forces"], keys["stress"],
                         keys["virial"])
    _refuse_absent_named_keys(path, ds, keys, named)
    if len(ds) and not ds.label_counts().any():
        inv = inventory(path, limit=1000)
        hints = [f"{LABEL_FLAGS[p]} {k}" for p in ("energy", "forces", "stress")
                 for k in [suggest_key(inv, p)] if k and k != keys[p]]
        fix = ("; name them with " + " ".join(hints)) if hints else \
            "; name the file's labels with --energy-key/--forces-key/--stress-key"
        raise DataFileError(
            f"{path!r} holds no energy, forces or stress label (keys {keys['energy']!r}, "
            f"{keys['forces']!r}, {keys['stress']!r}/{keys['virial']!r}): there is nothing to "
            f"compare the model with; {describe_keys(inv)}{fix}, or get predictions with "
            "xnn.Calculator or xnn md")
    return EvalData(ds, Path(path).stem, f"{len(ds)} structures of {path}")


def _refuse_absent_named_keys(path: str, ds, keys: dict[str, str], named) -> None:
    """Raise when no structure of ``ds`` holds a label whose key the user named."""
    counts = ds.label_counts().sum(0) if len(ds) else [0, 0, 0]
    absent = [p for p in named if counts[("energy", "forces", "stress").index(p)] == 0]
    if not absent:
        return
    inv = inventory(path, limit=1000)
    flags = ", ".join(f"{LABEL_FLAGS[p]} {keys[p]!r}" for p in absent)
    raise DataFileError(f"{flags}: no structure of {path!r} holds "
                        f"{' or '.join(absent)} under that key; {describe_keys(inv)} "
                        f"(`xnn data inspect {path}` lists them)")


def read_split_record(run_dir: str | Path) -> dict:
    """The ``split.json`` of a training run folder, each row's ``indices`` an integer
    array (:func:`xnn.app.split_record.read_split`: this version's record and earlier ones).

    Raises:
        InputError: ``run_dir`` is not a run folder, or has no (readable) ``split.json``
            (or its ``split.npy`` is missing or another).
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise InputError(f"--split needs a training run folder (output_dir of xnn train), "
                         f"got {str(run)!r}")
    path = run / "split.json"
    if not path.is_file():
        raise InputError(f"{run} has no split.json (written by xnn train when a run "
                         "completes; runs of earlier xnn versions have none): evaluate a "
                         "file instead, xnn eval MODEL DATA")
    from xnn.app.split_record import read_split

    return read_split(path)


def _open_recorded(entry: dict, run: Path):
    """The dataset of one file of a split record, after checking it is the file trained on."""
    from xnn.distributed.agreement import file_fingerprint

    path = entry["abs_path"]
    if not Path(path).is_file():
        path = entry["path"]  # the project folder moved: the path as given in the config
    now = file_fingerprint(path)
    if now != entry["fingerprint"]:
        raise DataFileError(
            f"{entry['path']} ({entry['config_key']} of the run in {run}) is not the file the "
            f"run was trained on: it is {now}, the run recorded {entry['fingerprint']}; "
            "restore that file, or evaluate another file with xnn eval MODEL DATA")
    return read_structures(path, entry["weight"], entry["energy_key"], entry["forces_key"],
                           entry["stress_key"], entry["virial_key"],
                           entry.get("format"))  # records before formats have none


def split_data(run_dir: str | Path, split: str) -> EvalData:
    """The structures of ``split`` (``train``, ``val`` or ``test``) of a training run.

    Raises:
        InputError: no split record, or the split is empty.
        DataFileError: a data file is missing or changed since the run.
    """
    if split not in SPLITS:
        raise InputError(f"--split {split!r} is not one of {list(SPLITS)}")
    run = Path(run_dir)
    record = read_split_record(run)
    rows = record.get(split) or []
    if not rows:
        raise InputError(f"the run in {run} has no {split} structures (see its "
                         f"data.{split}_fraction / data.{split} in config.yaml)")
    opened: dict[int, object] = {}
    parts = []
    for row in rows:
        i = row["file"]
        if i not in opened:
            opened[i] = _open_recorded(record["files"][i], run)
        parts.append(Subset(opened[i], row["indices"]))
    ds = parts[0] if len(parts) == 1 else ConcatDataset(parts)
    where = ", ".join(f"{len(row['indices'])} of {record['files'][row['file']]['path']}"
                      for row in rows)
    return EvalData(ds, f"{split}_eval", f"{len(ds)} structures, the {split} split of the "
                    f"run in {run} ({where})")


def check_finite_weights(model: torch.nn.Module, path: str) -> None:
    """Raise :class:`ModelFileError` when a parameter or buffer of the model is NaN or inf."""
    bad = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        n = len(list(model.parameters())) + len(list(model.buffers()))
        raise ModelFileError(f"{path} holds non-finite weights ({len(bad)} of {n} tensors, "
                             f"first {bad[0]!r}): its predictions would be NaN; use another "
                             "checkpoint (checkpoints/best.pt) or retrain")


def check_finite_metrics(metrics: dict, path: str, data: EvalData) -> None:
    """Raise :class:`ModelFileError` when a metric is NaN or infinite (the model predicts
    non-finite values on these structures)."""
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise ModelFileError(f"the errors of {path} on {data.description} are not finite "
                             f"({', '.join(bad)}): the model predicts NaN or inf for some "
                             "structures; no metrics or plot written")


__all__ = ["EvalData", "labelled_data", "split_data", "read_split_record",
           "check_finite_weights", "check_finite_metrics", "uncertainty_metrics"]


@dataclass(frozen=True)
class EvalOptions:
    """What ``xnn eval`` evaluates (see ``xnn eval --help``).

    Attributes:
        model: model file, or with ``split`` a training run folder.
        data: labelled structures (not with ``split``). split: ``train``, ``val`` or ``test``.
        keys: label key by property (``energy``, ``forces``, ``stress``) where given
            (``None``: the property's name; not with ``split``).
        batch_size: structures per batch. device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``.
        plot: parity plot PNG (``None``: next to the model). json: metrics file (``None``:
        none). trust_file: load a model file that may unpickle code. head: the head of a
        multi-head model that predicts (``None``: its default; :mod:`xnn.models.heads`).
    """

    model: str
    data: str | None = None
    split: str | None = None
    keys: tuple[tuple[str, str | None], ...] = ()
    batch_size: int = 8
    device: str = "auto"
    plot: str | None = None
    json: str | None = None
    trust_file: bool = False
    head: str | None = None


@dataclass
class EvalResult:
    """The metrics of one ``xnn eval`` and where they were written."""

    model_file: str
    description: str
    metrics: dict
    plot: Path
    json: Path | None
    calibration_plot: Path | None = None


def eval_inputs(opts: EvalOptions) -> tuple[str, EvalData]:
    """The model file and the structures to evaluate (one line for a wrong combination)."""
    given = {k: v for k, v in opts.keys if v is not None}
    if opts.split is not None:
        if opts.data is not None:
            raise InputError(f"--split {opts.split} evaluates the run folder's own data: give "
                             f"only the run folder (xnn eval --split {opts.split} RUN_DIR), "
                             f"not {opts.data!r}")
        if given:
            raise InputError(f"{', '.join(LABEL_FLAGS[k] for k in given)} cannot be used with "
                             "--split: the run's split.json names the keys each file was "
                             "trained with")
        return str(Path(opts.model) / "model.pt"), split_data(opts.model, opts.split)
    if opts.data is None:
        raise InputError("give the labelled data to evaluate on (xnn eval MODEL DATA), or "
                         "--split test with a training run folder (xnn eval --split test "
                         "RUN_DIR)")
    keys = {k: given.get(k, k) for k in ("energy", "forces", "stress")}
    return opts.model, labelled_data(opts.data, {**keys, "virial": "virial"}, tuple(given))


def run_eval(opts: EvalOptions) -> EvalResult:
    """Evaluate ``opts.model``; write the parity plot (and the metrics JSON).

    Raises:
        InputError, DataFileError, ModelFileError: one line, before anything is written.
    """
    from xnn import plotting
    from xnn._files import check_output_file
    from xnn._torch_files import refuse_non_model_file
    from xnn.devices import resolve_device
    from xnn.models.heads import select_head
    from xnn.models.serialization import load_model
    from xnn.training.evaluate import evaluate_model

    if opts.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {opts.batch_size}")
    model_file, data = eval_inputs(opts)
    plot = check_output_file(opts.plot, "--plot", "parity.png") if opts.plot else \
        Path(model_file).resolve().parent / f"parity_{data.name}.png"
    out_json = check_output_file(opts.json, "--json", "metrics.json") if opts.json else None
    if Path(model_file).is_file():
        refuse_non_model_file(model_file)  # truncated, or a training/MD checkpoint
    model = select_head(load_model(model_file, trust=opts.trust_file), opts.head, "--head")
    check_finite_weights(model, model_file)
    metrics, parity = evaluate_model(model, data.dataset, opts.batch_size,
                                     resolve_device(opts.device))
    check_finite_metrics(metrics, model_file, data)
    plot.parent.mkdir(parents=True, exist_ok=True)
    plotting.parity(parity["energy"], parity["forces"], plot, title=data.name,
                    stress=parity.get("stress"))
    calibration_plot = None
    if committee_size(model) > 1:
        metrics.update(uncertainty_metrics(model, parity))
        calibration_plot = plot.with_name(f"calibration_{data.name}.png")
        plotting.calibration(calibrated_rows(parity, {}), calibration_plot, data.name,
                             factors=model.calibration)
    if out_json is not None:
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(metrics, indent=2))
    return EvalResult(model_file, data.description, metrics, plot, out_json,
                      calibration_plot)


def uncertainty_metrics(model, parity: dict) -> dict[str, float]:
    """A committee's uncertainty on evaluated data, per property with labels: its stored
    calibration factor (``<p>_calibration``), the RMS of its calibrated std and of the
    observed error (``<p>_std_rms``, ``<p>_error_rms``, in the metric units: meV/atom,
    meV/Å per atom, meV/Å³) and their ratio (``<p>_uncertainty_ratio``: 1 when calibrated
    for these data; the factor that would calibrate them is the stored one times it).

    Args:
        parity: from :func:`xnn.training.evaluate.evaluate_model` (calibrated stds).
    """
    from xnn.training.committee import calibration_factor

    out: dict[str, float] = {}
    for prop, rows in calibrated_rows(parity, {}).items():
        err, std = rows[:, 0], rows[:, 1]
        out[f"{prop}_calibration"] = float(model.calibration[prop])
        out[f"{prop}_std_rms"] = 1000.0 * float(np.sqrt(np.mean(std ** 2)))
        out[f"{prop}_error_rms"] = 1000.0 * float(np.sqrt(np.mean(err ** 2)))
        ratio = calibration_factor(err, std)
        if ratio is not None:
            out[f"{prop}_uncertainty_ratio"] = ratio
    return out

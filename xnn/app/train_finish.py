"""End of a run: final weights, validation/test metrics, model file, plots, summary; for a
committee, its calibration on the validation set (``summary.json``'s ``committee`` record,
``calibration_val.png``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from xnn.config.train import TrainConfig
from xnn.training.checkpoint import load_checkpoint
from xnn.training.committee import committee_size


def _final_weights(loop) -> str:
    """Load the best checkpoint's weights (if any) into the trainer; return their origin."""
    best = loop.ckpt_dir / "best.pt"
    if loop.cfg.validation_only or not best.is_file():
        return "last"
    payload = load_checkpoint(best)
    t = loop.trainer
    t.model.load_state_dict(payload["model"]["state_dict"], strict=True)
    if t.ema is not None and payload.get("ema") is not None:
        t.ema.load_state_dict(payload["ema"])
    return f"best (epoch {payload['progress']['best_epoch']})"


def _plots(loop, parities: dict) -> list[str]:
    from xnn import plotting

    out = loop.out_dir
    written = []
    if loop.progress.history:
        written.append(str(plotting.learning_curves(loop.progress.history,
                                                    out / "learning_curves.png")))
    for name, parity in parities.items():
        if parity is not None and parity.get("energy") is not None:
            written.append(str(plotting.parity(parity["energy"], parity["forces"],
                                               out / f"parity_{name}.png", title=name,
                                               stress=parity.get("stress"))))
    return written


def _gather_parity(reducer, parity):
    import numpy as np

    if parity is None:
        return None
    parts = reducer.gather_objects(parity)
    merged = {}
    for key in parity:
        arrays = [p[key] for p in parts if p.get(key) is not None]
        merged[key] = np.concatenate(arrays) if arrays else None
    return merged


def _save_final(loop, save_model, convention: str | None) -> Path:
    """Save the model (EMA weights if any) as ``model.pt`` in the run folder, with the run's
    training precision and E0 convention (:func:`e0_convention`) recorded."""
    t = loop.trainer
    path = Path(loop.out_dir) / "model.pt"
    precision = loop.cfg.precision
    if t.ema is not None:
        with t.ema.applied(t.model):
            save_model(t.model, path, precision=precision, e0_convention=convention)
    else:
        save_model(t.model, path, precision=precision, e0_convention=convention)
    return path


def e0_convention(cfg: TrainConfig) -> str | None:
    """How the run's model got its reference energies: ``model.e0``'s convention (``given``
    for a map), or ``None`` for a fine-tuned model (it keeps the pretrained E0s)."""
    return None if cfg.pretrained else cfg.model.e0_convention()


def e0_record(cfg: TrainConfig, model) -> dict:
    """``{"convention": ..., "values": {symbol: eV}}`` of the run's model, for the summary."""
    from xnn.models.base import as_model
    from xnn.training.data import symbols

    e0 = as_model(model).e0 or {}
    return {"convention": e0_convention(cfg),
            "values": {symbols([z])[0]: float(v) for z, v in sorted(e0.items())}}


def write_split(cfg: TrainConfig, membership: dict | None, path: Path) -> None:
    """Save which structures of which file were trained on, validated and tested on
    (``split.json`` and its index array ``split.npy``, :mod:`xnn.app.split_record`), with
    each file's identity (size and SHA-256), so that ``xnn eval --split test RUN_DIR``
    evaluates exactly the test set."""
    from xnn.app.split_record import write_split as write_record
    from xnn.distributed.agreement import file_fingerprint

    if membership is None:
        return
    files = [{**f, "abs_path": str(Path(f["path"]).resolve()),
              "fingerprint": file_fingerprint(f["path"])} for f in membership["files"]]
    write_record(membership, {"seed": cfg.seed, "files": files}, path)


def _final_path(cfg: TrainConfig, loop, path) -> str:
    """Where a file the run writes ends up: a run that replaces a previous one is written to
    a staging folder and moved into ``output_dir`` when it completes."""
    return str(Path(cfg.output_dir) / Path(path).relative_to(loop.out_dir))


def finish_run(cfg: TrainConfig, loop, reason: str, elapsed_s: float) -> dict:
    """Evaluate, save ``model.pt`` (EMA weights of the best epoch), plots and ``summary.json``."""
    from xnn.models.serialization import save_model

    loop.reducer.barrier()  # every checkpoint of rank 0 is on disk before others read it
    origin = _final_weights(loop)
    model = loop.trainer.model
    kept = None
    if committee_size(model) > 1:  # the parities hold the raw spreads (factors 1)
        kept = dict(model.calibration)
        model.set_calibration(dict.fromkeys(kept, 1.0))
    metrics: dict = {}
    parities: dict = {}
    for name, ds in (("val", loop.splits.val), ("test", loop.splits.test)):
        m, parity = loop.validate(ds, f"{name}_", collect=True)
        metrics.update(m)
        parities[name] = _gather_parity(loop.reducer, parity)
    metrics.update(loop.validate(loop.splits.val_replay, "val_replay_")[0])  # fine-tuning
    committee = None if kept is None else calibrate(cfg, model, kept, parities.get("val"))
    summary = {
        "stopped_by": reason,
        "epochs": loop.progress.epoch,
        "steps": loop.progress.step,
        "final_weights": origin,
        "checkpoint_metric": cfg.checkpoint_metric,
        "checkpoint_mode": cfg.checkpoint_mode,
        "precision": cfg.precision,
        "best_value": loop.progress.best_value if loop.progress.best_epoch >= 0 else None,
        "elapsed_s": elapsed_s,
        "metrics": metrics,
        "units": {"energy": "meV/atom", "forces": "meV/Å", "stress": "meV/Å³"},
    }
    if committee is not None:
        summary["committee"] = committee
    if loop.reducer.is_main:
        if cfg.validation_only:  # never touch the files of the run that made the model
            summary["model"] = cfg.pretrained or cfg.resume
            path = Path(loop.out_dir) / "validation_summary.json"
        else:
            summary["model"] = _final_path(cfg, loop, _save_final(loop, save_model,
                                                                   e0_convention(cfg)))
            summary["e0"] = e0_record(cfg, loop.trainer.model)
            write_split(cfg, loop.splits.membership, Path(loop.out_dir) / "split.json")
            if cfg.logging.plots:
                shown = {k: v for k, v in parities.items() if v is not None}
                if "test" in shown:
                    shown = {"test": shown["test"]}
                summary["plots"] = [_final_path(cfg, loop, p) for p in _plots(loop, shown)]
                if committee is not None and parities.get("val") is not None:
                    summary["plots"].append(_final_path(cfg, loop, _calibration_plot(
                        loop, model, parities["val"])))
            path = Path(loop.out_dir) / "summary.json"
        path.write_text(json.dumps(summary, indent=2))
        _print_summary(loop.logger, summary)
    loop.reducer.barrier()
    return summary


def calibrate(cfg: TrainConfig, model, kept: dict[str, float], parity: dict | None) -> dict:
    """Give a committee its calibration factors: fitted on the validation parity's
    (|error|, raw std) rows (:func:`~xnn.training.committee.fit_calibration`) with
    ``committee.calibrate``, else (or for a property without data) the factors it had
    (``kept``). Returns the summary's ``committee`` record: size, factors, where they were
    fitted, and the validation set's RMS error and RMS calibrated std per property (meV
    units)."""
    from xnn.training.committee import calibrated_rows, fit_calibration

    fitted = fit_calibration(parity) if (cfg.committee.calibrate and parity) else {}
    model.set_calibration({**kept, **fitted})
    record: dict = {"size": model.committee_size, "calibration": dict(model.calibration),
                    "calibrated_on": "val" if fitted else None}
    rows = calibrated_rows(parity or {}, model.calibration)
    record["val_uncertainty"] = {
        prop: {"error_rms": 1000.0 * float(np.sqrt(np.mean(r[:, 0] ** 2))),
               "std_rms": 1000.0 * float(np.sqrt(np.mean(r[:, 1] ** 2)))}
        for prop, r in rows.items()}
    return record


def _calibration_plot(loop, model, parity: dict) -> Path:
    from xnn import plotting
    from xnn.training.committee import calibrated_rows

    return plotting.calibration(calibrated_rows(parity, model.calibration),
                                Path(loop.out_dir) / "calibration_val.png", "val",
                                factors=model.calibration)


def _print_summary(logger, summary: dict) -> None:
    m = summary["metrics"]
    for split in ("val", "test"):
        keys = [f"{split}_energy_mae", f"{split}_forces_mae", f"{split}_stress_mae"]
        if any(k in m for k in keys):
            parts = [f"{k.split('_')[1]} MAE {m[k]:.3g}" for k in keys if k in m]
            logger.print(f"{split}: " + ", ".join(parts) + " (meV/atom, meV/Å, meV/Å³)")
    if "committee" in summary:
        c = summary["committee"]
        factors = ", ".join(f"{k} {v:.3g}" for k, v in c["calibration"].items())
        logger.print(f"committee of {c['size']}: calibration factors {factors}"
                     + (" (fitted on val)" if c["calibrated_on"] else ""))
    logger.print(f"stopped by {summary['stopped_by']} after {summary['epochs']} epochs, "
                 f"{summary['steps']} steps; model: {summary.get('model')}")

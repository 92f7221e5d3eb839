"""The application behind ``xnn validate``: a model in one process vs decomposed over all
ranks, compared by atom id (see :mod:`xnn.distributed.validate`)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ValidateOptions:
    """What ``xnn validate`` compares (see ``xnn validate --help``).

    Attributes:
        model: model file or built-in spec (``lj:sigma=2.3``). structure: structure file.
        index: frame of ``structure``. dtype: ``float64`` or ``float32``.
        grid: boxes ``"px,py,pz"`` (``None``: automatic). mode: a key of
        :data:`~xnn.distributed.modes.MODES` (``auto``, ``spatial``, ``halo``, ``sync``,
        ``graph``). order: atom order of mode ``graph`` (``morton`` or ``index``).
        balance: how the spatial modes cut boxes (``none``, ``shift``: as
        ``parallel.balance`` of xnn md). exchange: how the spatial modes send ghost rows
        (``direct``, ``staged``: as ``parallel.exchange``).
        skin: Verlet skin (Å). tol: largest relative error that passes.
        json: report file (rank 0). skip_reference: decomposed single point only.
        output: structure file with the decomposed results (rank 0).
        device: ``cpu`` or ``cuda`` (``None``: cuda if available).
        timeout: collective timeout (s). trust_file: load model files holding pickled code.
    """

    model: str
    structure: str
    index: str = "-1"
    dtype: str = "float64"
    grid: str | None = None
    mode: str = "auto"
    skin: float = 0.0
    tol: float = 1e-10
    json: str | None = None
    skip_reference: bool = False
    output: str | None = None
    device: str | None = None
    timeout: float = 600.0
    trust_file: bool = False
    order: str = "morton"
    balance: str = "none"
    exchange: str = "direct"


def _report_lines(report: dict, tol: float) -> list[str]:
    lines = [f"{'quantity':<10} {'max abs error':>14} {'max rel error':>14} {'scale':>12}"]
    for name, r in report.items():
        lines.append(f"{name:<10} {r['max_abs']:>14.3e} {r['max_rel']:>14.3e} {r['scale']:>12.4g}")
    worst = max(r["max_rel"] for r in report.values())
    lines.append(f"worst relative error {worst:.3e} ({'PASS' if worst <= tol else 'FAIL'}, "
                 f"tol {tol:.1e})")
    return lines


def check_options(opts: ValidateOptions) -> ValidateOptions:
    """``opts`` with ``device`` resolved, after checking every option that needs no file and
    no other rank: before any rank starts, so a wrong option is one line on every rank.

    Raises:
        InputError: one line naming the option: ``--tol`` not a finite number > 0, an
            unknown or absent ``--device``, ``--output`` or ``--json`` a folder (or under a
            file).
    """
    import math

    from xnn._files import check_output_file
    from xnn.devices import resolve_device
    from xnn.errors import InputError

    if not (math.isfinite(opts.tol) and opts.tol > 0):
        raise InputError(f"--tol must be a finite number > 0, got {opts.tol}")
    if opts.output is not None:
        check_output_file(opts.output, "--output", example="validated.xyz")
    if opts.json is not None:
        check_output_file(opts.json, "--json", example="report.json")
    if opts.device is None:
        return opts
    return replace(opts, device=str(resolve_device(opts.device)))


def _write_output(path: str, graph, out) -> None:
    from pathlib import Path

    import numpy as np
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    from xnn.data.ase_io import to_ase

    atoms = to_ase(graph.detach().to("cpu"))[0]
    order = np.argsort(graph.atom_id.cpu().numpy())
    forces = np.empty((len(atoms), 3))
    forces[order] = out["forces"].cpu().numpy()
    results = {"energy": float(out["energy"].sum()), "forces": forces}
    if bool(graph.pbc.all()):
        results["stress"] = out["stress"][0].cpu().numpy()
    atoms.calc = SinglePointCalculator(atoms, **results)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write(path, atoms)


def _report(opts: ValidateOptions, manager, dd, graph, out, ref, seconds: dict) -> bool:
    """Print (and write) the comparison on rank 0; True if above the tolerance."""
    import json
    from pathlib import Path

    from xnn.distributed import validate as V

    info = {"world_size": manager.world_size, "n_atoms": graph.n_atoms,
            "grid": dd.stats()["grid"], "halo_width": dd.halo_width, "mode": dd.mode,
            "balance": opts.balance, "exchange": opts.exchange,
            "energy": float(out["energy"].sum()), **seconds}
    if dd.reason:
        info["mode_reason"] = dd.reason
    layout = (f"grid {'x'.join(map(str, info['grid']))}" if info["grid"]
              else f"{dd.stats().get('order', 'index')} order")
    print(f"xnn validate: {graph.n_atoms} atoms on {manager.world_size} rank(s), "
          f"{layout}, halo {dd.halo_width:.3g} Å, mode {dd.mode}; "
          f"energy {info['energy']:.10g} eV ({seconds['seconds_decomposed']:.3g} s decomposed)")
    failed = False
    if ref is not None:
        report = V.compare(out, ref, graph)
        info.update(report=report, tol=opts.tol)
        print("\n".join(_report_lines(report, opts.tol)))
        failed = max(r["max_rel"] for r in report.values()) > opts.tol
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps(info, indent=2))
    if opts.output:
        _write_output(opts.output, graph, out)
    return failed


def options_fingerprint(opts: ValidateOptions) -> dict[str, str]:
    """Every option of a rank, the structure file (and a model file) by content: what the
    ranks compare before their first other collective (see
    :func:`~xnn.distributed.agreement.check_ranks_agree`)."""
    from pathlib import Path

    from xnn.distributed.agreement import run_fingerprint

    files = {"structure": opts.structure}
    if Path(opts.model).is_file():  # else a built-in spec, compared as written
        files["model"] = opts.model
    return run_fingerprint(opts, files)


def run_validate(opts: ValidateOptions) -> int:
    """Evaluate ``opts.model`` on ``opts.structure`` in one process (rank 0) and decomposed
    over all ranks of the launch; print (and write) the comparison on rank 0.

    Returns:
        the exit status on every rank: 1 if the worst relative error exceeds ``opts.tol``,
        else 0.
    Raises:
        InputError: on every rank, before anything is read or written: a wrong option
            (:func:`check_options`), or ranks given different options, structure or model
            files (naming the options).
    """
    import time

    import torch

    from xnn.app.model_spec import load_model_everywhere
    from xnn.distributed import DistributedManager
    from xnn.distributed import collectives as C
    from xnn.distributed import validate as V
    from xnn.distributed.agreement import check_ranks_agree
    from xnn.distributed.domain.partition import parse_grid
    from xnn.distributed.parallelize import parallelize

    dtype = getattr(torch, opts.dtype)
    grid = parse_grid(opts.grid)
    opts = check_options(opts)
    manager = DistributedManager.initialize(timeout_s=opts.timeout, device=opts.device,
                                            timeout_key="--parallel.timeout_s")
    try:
        if manager.is_distributed:  # the first collective: every rank runs the same job
            check_ranks_agree(options_fingerprint(opts))
        graph = V.read_structure_rank0(opts.structure, opts.index)
        species = C.broadcast_object(
            None if graph is None else sorted(set(graph.numbers.tolist())))
        model = load_model_everywhere(opts.model, species, trust=opts.trust_file)
        model = model.to(manager.device, dtype)
        graph = None if graph is None else graph.to(manager.device, dtype)  # rank 0 only
        dd = parallelize(model, manager, opts.mode, graph=graph, grid=grid, skin=opts.skin,
                         order=opts.order, balance=opts.balance, exchange=opts.exchange)
        ref, seconds = None, {}
        with C.guarded(None, "single-process reference"):
            if manager.is_main and not opts.skip_reference:
                t0 = time.perf_counter()
                ref = V.single_process(model, graph)
                seconds["seconds_single"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = dd.single_point(graph)
        seconds["seconds_decomposed"] = time.perf_counter() - t0
        status = torch.zeros(1, device=manager.device)
        with C.guarded(None, "report on rank 0"):
            if manager.is_main:
                status[0] = float(_report(opts, manager, dd, graph, out, ref, seconds))
        C.all_reduce_(status)
        return int(status.item() > 0)
    finally:
        manager.cleanup()

"""The ``xnn`` command. Each subcommand lives in its own module under ``xnn.cli`` and
provides ``add_parser(subparsers)`` and ``run(args) -> int``; heavy imports happen in ``run``.

Import path. Hooks (``target: package.module:function``) import code by name. The ``xnn``
command does not look for modules in the working directory; ``python -m xnn`` and
``torchrun -m xnn`` would (Python puts the working directory first on ``sys.path`` for
``-m``), so :func:`drop_working_directory` removes that entry and the three behave the same.
A user who wants ``./mymod.py`` importable says so with ``PYTHONPATH=.``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from xnn._version import __version__
from xnn.cli.allocator import keep_large_blocks
from xnn.errors import XnnError

# subcommand name -> module; modules that do not exist yet are skipped
SUBCOMMANDS = {
    "demo": "xnn.cli.demo",
    "data": "xnn.cli.data",
    "train": "xnn.cli.train",
    "eval": "xnn.cli.eval",
    "md": "xnn.cli.md",
    "relax": "xnn.cli.relax",
    "validate": "xnn.cli.validate",
    "export": "xnn.cli.export",
    "committee": "xnn.cli.committee",
    "run": "xnn.cli.run",
    "lammps": "xnn.cli.lammps",
    "learn": "xnn.cli.learn",
    "traj": "xnn.cli.traj",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xnn",
        description="xnn: train machine-learned interatomic potentials, run MD with them, "
        "and scale across GPUs by domain decomposition.",
    )
    parser.add_argument("--version", action="version", version=f"xnn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
                continue
            raise
        mod.add_parser(sub)
    return parser


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def one_line(message: str) -> str:
    """``message`` without terminal escape codes, its lines joined into one."""
    return " ".join(_ANSI.sub("", message).split())


def drop_working_directory() -> None:
    """Remove the working directory that ``python -m`` put first on ``sys.path`` (entries the
    user added with ``PYTHONPATH`` stay; nothing is removed under ``python -P``)."""
    if sys.flags.safe_path or not sys.path:
        return
    if sys.path[0] in ("", os.getcwd()):
        del sys.path[0]


#: options whose value may start with "-" (an ASE index such as -3: or -1)
DASH_VALUE_OPTIONS = ("--index",)


def attach_dash_values(argv: list[str]) -> list[str]:
    """``--index -3:`` as ``--index=-3:``: argparse takes a value that starts with ``-`` and
    is not a plain negative number (``-3:``, ``-5::2``) for an option and refuses it."""
    out = list(argv)
    for k in range(len(out) - 2, -1, -1):
        if out[k] in DASH_VALUE_OPTIONS and out[k + 1].startswith("-"):
            out[k:k + 2] = [f"{out[k]}={out[k + 1]}"]
    return out


def main(argv: list[str] | None = None) -> int:
    """The ``xnn`` command; ``argv=None`` (a program's start: the console script, ``python -m
    xnn``) also keeps glibc's large freed blocks mapped (:mod:`xnn.cli.allocator`), which
    calls from Python with an ``argv`` leave alone."""
    if argv is None:
        keep_large_blocks()
    parser = build_parser()
    args = parser.parse_args(attach_dash_values(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except XnnError as e:
        print(f"xnn {args.command}: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    drop_working_directory()
    sys.exit(main())

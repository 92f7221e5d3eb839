"""The layers of ``shared/design.md`` §2, checked on the source: an AST walk over ``xnn/``
that fails on an import (module level or inside a function) pointing up the layer order,
on an import cycle between modules, and on file writing in ``dynamics/`` and ``training/``
(libraries that take plain objects and write no files: the I/O layer writes them).

The table :data:`LAYERS` is the one statement of the order; the allow-lists below name the
known exceptions, each with its reason, to be removed as they are fixed.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The layers, lowest first; a module may import its own component and the layers below.
#: Components of one layer (``training`` and ``dynamics``) do not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("xnn.units", "xnn.errors", "xnn._version"),  # constants, error types: used everywhere
    ("xnn._files", "xnn._torch_files", "xnn.devices"),  # atomic writes, model-file checks,
                                                        # the device of "auto"
    ("xnn.data",),                      # AtomicGraph, keys, ASE/HDF5 reading, datasets
    ("xnn.neighbors",),                 # neighbor lists, datasets with edges
    ("xnn.models",),                    # per-atom energies, derivatives, model files
    ("xnn.training", "xnn.dynamics"),   # libraries: no config, no files, no torch.distributed
    ("xnn.distributed",),               # parallelism applied from outside
    ("xnn.io", "xnn.plotting"),         # calculator, trajectory/checkpoint/thermo writers, plots
    ("xnn.interop",),                   # torch-sim and LAMMPS adapters
    ("xnn.config",),                    # typed schema + YAML/dotlist
    ("xnn.app",),                       # config -> objects -> parallelize -> run -> files
    ("xnn.cli",),                       # argument shells over app/
    ("xnn.testing",),                   # contracts for model authors (may use any layer)
    ("xnn", "xnn.__main__"),            # the package's lazy facade and ``python -m xnn``
)

#: ``(importer, imported)`` -> reason, for imports up the order not yet fixed.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

#: import cycles not yet broken (the modules of each), with the reason.
ALLOWED_CYCLES: dict[frozenset[str], str] = {
}

#: ``(module, call)`` -> reason, for file writing in ``dynamics/``/``training/`` not yet moved.
ALLOWED_WRITES: dict[tuple[str, str], str] = {}

#: calls that write, create, move or remove files, by their dotted name...
WRITE_CALLS = frozenset({
    "torch.save", "np.save", "np.savez", "np.savez_compressed", "np.savetxt", "numpy.save",
    "json.dump", "pickle.dump", "yaml.dump", "yaml.safe_dump", "os.replace", "os.rename",
    "os.remove", "os.unlink", "os.makedirs", "os.mkdir", "shutil.copy", "shutil.copyfile",
    "shutil.copy2", "shutil.move", "shutil.rmtree", "atomic_write", "atomic_write_text",
    "atomic_write_bytes", "SummaryWriter", "torch.cuda.memory._dump_snapshot",
})
#: ... by the name of the method called...
WRITE_METHODS = frozenset({"savefig", "write_text", "write_bytes", "mkdir", "touch", "to_csv",
                           "unlink", "rmdir", "symlink_to", "hardlink_to"})
#: ... and calls that write when given one of these modes (``open``, ``Path.open``, h5py).
MODE_CALLS = frozenset({"open", "h5py.File", "File", "gzip.open", "bz2.open", "lzma.open"})
NO_WRITE_DIRS = ("xnn.dynamics", "xnn.training")


# ----------------------------------------------------------------------------- the walk
def parse(path: Path) -> ast.Module:
    """The syntax tree of ``path`` (parsed once per content)."""
    return _parse(str(path), path.read_text())


@functools.cache
def _parse(name: str, text: str) -> ast.Module:
    return ast.parse(text, name)


def modules(root: Path) -> dict[str, Path]:
    """``{dotted name: file}`` of every module under ``root/xnn``."""
    out = {}
    for path in sorted((root / "xnn").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def component(name: str) -> tuple[int, str]:
    """``(layer index, component)`` of module ``name``: its longest prefix in :data:`LAYERS`."""
    best = None
    for rank, layer in enumerate(LAYERS):
        for comp in layer:
            inside = name == comp or (comp != "xnn" and name.startswith(comp + "."))
            if inside and (best is None or len(comp) > len(best[1])):
                best = (rank, comp)
    if best is None:
        raise LookupError(f"{name} is in no layer of LAYERS: place it there")
    return best


def _resolve(name: str, known: dict[str, Path]) -> str:
    """The module ``name`` denotes: itself, else its longest prefix that is a module."""
    while name not in known and "." in name:
        name = name.rpartition(".")[0]
    return name


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every xnn module ``name`` imports, at module level or in a
    function (``from pkg import sub`` counts ``pkg.sub`` when it is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(head + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        found = {_resolve(t, known) for t in targets if t == "xnn" or t.startswith("xnn.")}
        for target in sorted(found - {name}):
            yield node.lineno, target


def upward_imports(root: Path) -> list[str]:
    """Every import that points up :data:`LAYERS` or across components of one layer."""
    known = modules(root)
    bad = []
    for name, path in known.items():
        rank, comp = component(name)
        for line, target in imports(name, path, known):
            t_rank, t_comp = component(target)
            if t_comp == comp or t_rank < rank or (name, target) in ALLOWED_UPWARD:
                continue
            bad.append(f"{path.relative_to(root)}:{line}: {name} ({comp}) imports {target} "
                       f"({t_comp}), {'a peer' if t_rank == rank else 'a layer above'}")
    return bad


def import_cycles(root: Path) -> list[frozenset[str]]:
    """The strongly connected sets of modules (more than one) of the import graph."""
    known = modules(root)
    graph = {name: {t for _, t in imports(name, path, known)} for name, path in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.add(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(frozenset(scc))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _dotted(func: ast.expr) -> str:
    """``a.b.c`` of a called expression (``""`` when it is not a dotted name)."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
        return ".".join(reversed(parts))
    return ""


def _write_mode(call: ast.Call, position: int) -> bool:
    """Whether the call's mode argument (``position`` or ``mode=``) writes."""
    mode = call.args[position] if len(call.args) > position else next(
        (k.value for k in call.keywords if k.arg == "mode"), None)
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and any(
        c in mode.value for c in "wax+")


def file_writes(root: Path) -> list[str]:
    """Every call in ``dynamics/`` or ``training/`` that writes a file."""
    bad = []
    for name, path in modules(root).items():
        if not name.startswith(NO_WRITE_DIRS):
            continue
        for node in ast.walk(parse(path)):
            if not isinstance(node, ast.Call):
                continue
            dotted = _dotted(node.func)
            method = node.func.attr if isinstance(node.func, ast.Attribute) else ""
            last = dotted.rpartition(".")[2]
            if dotted in WRITE_CALLS or last in WRITE_CALLS:
                what = dotted if dotted in WRITE_CALLS else last
            elif method in WRITE_METHODS:
                what = method
            elif (dotted in MODE_CALLS and _write_mode(node, 1)) or (
                    method == "open" and dotted not in MODE_CALLS and _write_mode(node, 0)):
                what = f"{dotted or method}(..., write mode)"
            else:
                continue
            if (name, what) not in ALLOWED_WRITES:
                bad.append(f"{path.relative_to(root)}:{node.lineno}: {name} calls {what}")
    return bad


# ----------------------------------------------------------------------------- the checks
def test_every_module_has_a_layer():
    for name in modules(ROOT):
        component(name)  # raises for a module placed nowhere


def test_imports_point_down_the_layers():
    bad = upward_imports(ROOT)
    assert not bad, "imports up the layers (shared/design.md §2):\n" + "\n".join(bad)


def test_no_import_cycles():
    cycles = [sorted(c) for c in import_cycles(ROOT) if c not in ALLOWED_CYCLES]
    assert not cycles, f"import cycles (module level or in functions): {cycles}"


def test_dynamics_and_training_write_no_files():
    bad = file_writes(ROOT)
    assert not bad, "file writing outside the I/O layer:\n" + "\n".join(bad)


def test_allow_lists_name_only_what_is_still_there():
    """An entry fixed since is removed from its list (a stale entry hides nothing, but
    says something false)."""
    known = modules(ROOT)
    cycles = set(import_cycles(ROOT))
    assert not [c for c in ALLOWED_CYCLES if c not in cycles]
    for src, dst in ALLOWED_UPWARD:
        assert dst in {t for _, t in imports(src, known[src], known)}, (src, dst)
    saved = dict(ALLOWED_WRITES)
    try:
        ALLOWED_WRITES.clear()
        flagged = file_writes(ROOT)
    finally:
        ALLOWED_WRITES.update(saved)
    for module, call in saved:
        assert any(f" {module} calls {call}" in line for line in flagged), (module, call)


# ----------------------------------------------------------------------------- the checker
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return tmp_path


@pytest.fixture
def tree(tmp_path):
    """A small xnn-like tree: data, neighbors, dynamics, training, io, app."""
    base = {f"xnn/{p}/__init__.py": "" for p in
            ("data", "neighbors", "models", "dynamics", "training", "io", "app")}
    base["xnn/__init__.py"] = ""
    base["xnn/errors.py"] = "class InputError(ValueError): pass\n"
    base["xnn/data/graph.py"] = "from xnn.errors import InputError\n"
    base["xnn/neighbors/api.py"] = "from xnn.data import graph\n"
    base["xnn/dynamics/nve.py"] = "from xnn.neighbors.api import *\n"
    base["xnn/io/thermo.py"] = "import torch\n\ndef w(p, x):\n    torch.save(x, p)\n"
    base["xnn/app/md.py"] = "from xnn.io.thermo import w\nfrom xnn.dynamics import nve\n"
    return lambda extra: _tree(tmp_path, {**base, **extra})


def test_checker_passes_a_tree_that_keeps_the_layers(tree):
    root = tree({})
    assert upward_imports(root) == [] and import_cycles(root) == [] and file_writes(root) == []


@pytest.mark.parametrize("where, text, expected", [
    ("xnn/data/datasets.py", "from xnn.neighbors.api import with_edges\n",
     "xnn.data.datasets (xnn.data) imports xnn.neighbors.api (xnn.neighbors), a layer above"),
    ("xnn/data/datasets.py", "def f():\n    from xnn.app import md\n",
     "xnn.data.datasets (xnn.data) imports xnn.app.md (xnn.app), a layer above"),
    ("xnn/dynamics/x.py", "import xnn.io.thermo\n", "imports xnn.io.thermo"),
    ("xnn/dynamics/x.py", "def f():\n    from ..training import loop\n",
     "imports xnn.training (xnn.training), a peer"),
    ("xnn/models/m.py", "def f():\n    import xnn\n", "imports xnn (xnn), a layer above"),
])
def test_checker_finds_an_upward_import(tree, where, text, expected):
    bad = upward_imports(tree({where: text}))
    assert len(bad) == 1 and expected in bad[0], bad


def test_checker_finds_a_lazy_cycle(tree):
    root = tree({"xnn/data/a.py": "from xnn.data import b\n",
                 "xnn/data/b.py": "def f():\n    from xnn.data.a import g\n"})
    assert import_cycles(root) == [frozenset({"xnn.data.a", "xnn.data.b"})]


@pytest.mark.parametrize("text, call", [
    ("import torch\ndef f(s, p):\n    torch.save(s, p)\n", "torch.save"),
    ("def f(p):\n    with open(p, 'a') as fh:\n        fh.write('x')\n", "open(..., write mode)"),
    ("def f(p):\n    with open(p, mode='wb') as fh:\n        pass\n", "open(..., write mode)"),
    ("def f(p):\n    p.open('w')\n", "p.open(..., write mode)"),
    ("def f(fig, p):\n    fig.savefig(p)\n", "savefig"),
    ("def f(p):\n    p.write_text('x')\n", "write_text"),
    ("import numpy as np\ndef f(p, a):\n    np.savez(p, a=a)\n", "np.savez"),
    ("import json\ndef f(d, fh):\n    json.dump(d, fh)\n", "json.dump"),
    ("import os\ndef f(a, b):\n    os.replace(a, b)\n", "os.replace"),
    ("import h5py\ndef f(p):\n    h5py.File(p, 'w')\n", "h5py.File(..., write mode)"),
    ("from xnn._files import atomic_write_text\ndef f(p):\n    atomic_write_text(p, 'x')\n",
     "atomic_write_text"),
])
def test_checker_finds_a_file_write(tree, text, call):
    bad = file_writes(tree({"xnn/training/w.py": text}))
    assert len(bad) == 1 and bad[0].endswith(f"xnn.training.w calls {call}"), bad


def test_checker_lets_reading_pass(tree):
    text = ("import json, h5py, torch\ndef f(p):\n    open(p).read(); open(p, 'rb')\n"
            "    h5py.File(p, 'r'); json.loads('1'); torch.load(p); p.read_text()\n")
    assert file_writes(tree({"xnn/dynamics/r.py": text})) == []

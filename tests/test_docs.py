"""The documentation in the repository stays true to the code: links resolve, config keys and
commands named in the docs exist, and the package metadata builds without deprecated forms."""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
# a dotted config override inside code: data.datasets.0.path=..., optim.lr=...
OVERRIDE = re.compile(r"(?:^|\s)([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)=")
COMMAND = re.compile(r"(?:^|[\s`(])(?:-m )?xnn ([a-z][a-z-]*)\b")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(m) for m in re.findall(r"^#+\s+(.*)$", text, re.M)}


def _links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    """Every relative link of README.md and docs/*.md names an existing file (and heading)."""
    assert page.is_file()
    bad = []
    for target in _links(page):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not bad, f"{page.name}: broken links: {bad}"


def test_readme_links_into_the_repository():
    """The README points at docs/ in the repository, not at files outside it."""
    text = (ROOT / "README.md").read_text()
    assert "../shared" not in text and "shared/design" not in text
    linked = {Path(t.partition("#")[0]).name for t in _links(ROOT / "README.md")}
    for doc in ("architecture.md", "conventions.md", "user-guide.md", "model-authors.md",
                "distributed.md"):
        assert (ROOT / "docs" / doc).is_file(), doc
        assert doc in linked, f"README.md does not link docs/{doc}"


def _keys(schema: type, prefix: str = "") -> tuple[set[str], set[str]]:
    """(dotted keys with list indices as ``N``, prefixes of free-form dict keys)."""
    keys, free = set(), set()
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key, tp = prefix + f.name, hints[f.name]
        keys.add(key)
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if dataclasses.is_dataclass(tp):
            k, d = _keys(tp, key + ".")
        elif typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
            k, d = _keys(args[0], key + ".N.")
            k.add(key + ".N")
        elif typing.get_origin(tp) is dict:
            k, d = set(), {key}
        else:
            continue
        keys |= k
        free |= d
    return keys, free


def _known(key: str, schemas: list[type]) -> bool:
    norm = re.sub(r"\.\d+(?=\.|$)", ".N", key)
    for schema in schemas:
        keys, free = _keys(schema)
        if norm in keys or any(norm.startswith(p + ".") for p in free):
            return True
    return False


def _code(text: str) -> list[str]:
    return SPAN.findall(FENCE.sub("", text)) + [
        line for block in FENCE.findall(text) for line in block.splitlines()]


def test_user_guide_config_keys_exist():
    """Every ``section.key=`` in docs/user-guide.md is a key of the command's config schema
    (sections ``xnn train``/``md``/``relax``; elsewhere any schema)."""
    from xnn.config.md import MDConfig, RelaxConfig
    from xnn.config.train import TrainConfig
    from xnn.config.workflow import WorkflowConfig

    by_section = {"train": [TrainConfig], "md": [MDConfig], "relax": [RelaxConfig],
                  "run": [WorkflowConfig]}
    every = [TrainConfig, MDConfig, RelaxConfig]
    text = (ROOT / "docs" / "user-guide.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)
    bad, seen = [], 0
    for section in sections:
        title = section.splitlines()[0] if section else ""
        m = re.match(r"`xnn (\w+)`", title)
        schemas = by_section.get(m.group(1), every) if m else every
        for snippet in _code(section):
            for key in OVERRIDE.findall(snippet):
                seen += 1
                if not _known(key, schemas):
                    bad.append(f"{key} (section {title!r})")
    assert seen > 30, "the key pattern found almost nothing: the test would check nothing"
    assert not bad, f"config keys in docs/user-guide.md that no schema has: {bad}"


def test_key_check_catches_a_stale_key():
    """The checker refuses keys that do not exist (so the test above can fail)."""
    from xnn.config.md import MDConfig
    from xnn.config.train import TrainConfig

    assert _known("data.datasets.0.path", [TrainConfig])
    assert _known("model.hyperparameters.num_features", [TrainConfig])
    assert not _known("optim.learning_rate", [TrainConfig])
    assert not _known("data.train", [TrainConfig])
    assert _known("parallel.dd", [MDConfig])  # one parallel section for md and train
    assert not _known("dd.mode", [MDConfig])  # the former spelling
    assert not _known("model.backend", [TrainConfig])


def test_named_commands_exist():
    """Every ``xnn COMMAND`` written in README.md and docs/*.md is a subcommand of the CLI."""
    from xnn.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    commands = set(sub.choices)
    bad = set()
    for page in PAGES:
        for snippet in _code(page.read_text()):
            bad |= {f"{page.name}: xnn {c}" for c in COMMAND.findall(snippet)
                    if c not in commands}
    assert not bad, f"commands named in the docs that the CLI lacks: {sorted(bad)}"
    assert {"train", "md", "relax", "eval", "validate", "data", "demo"} <= commands


def test_version_option(capsys):
    """``xnn --version`` prints the package version and exits 0."""
    import xnn
    from xnn.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"xnn {xnn.__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)?", xnn.__version__)


def test_pyproject_metadata_is_not_deprecated():
    """The license is an SPDX string with its file (a table is deprecated by setuptools and
    makes ``pip install .`` warn), and the build backend is recent enough to read it."""
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python >= 3.11")
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = meta["project"]
    assert isinstance(project["license"], str), "use license = \"MIT\" (SPDX), not a table"
    for name in project.get("license-files", []):
        assert (ROOT / name).is_file(), name
    assert "classifiers" not in project or not any(
        c.startswith("License ::") for c in project["classifiers"]), \
        "license classifiers are deprecated next to an SPDX license"
    reqs = meta["build-system"]["requires"]
    st = next(r for r in reqs if r.startswith("setuptools"))
    m = re.search(r">=\s*(\d+)", st)
    assert m and int(m.group(1)) >= 77, f"{st}: SPDX license strings need setuptools>=77"
    assert project["scripts"]["xnn"] == "xnn.cli.main:main"

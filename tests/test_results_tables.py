"""The tables of benchmarks/results/README.md are what the JSON files beside it say."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: benchmarks/
from benchmarks import results_tables as rt  # noqa: E402
from benchmarks.results_commands import COMMANDS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def block_rows(text: str, name: str) -> list[list[str]]:
    """The body rows of table ``name`` in README ``text``, as lists of cells."""
    match = next(m for m in rt.BLOCK.finditer(text) if m["name"] == name)
    lines = [ln for ln in match[0].splitlines() if ln.startswith("| ")][1:]
    return [[cell.strip() for cell in ln.strip("|").split(" | ")] for ln in lines]


def test_readme_tables_equal_the_files():
    for doc in (rt.README, rt.FILES):
        text = doc.read_text()
        assert rt.rewrite(text, rt.tables()) == text, (
            f"benchmarks/results/{doc.name} differs from its JSON files: run "
            "python benchmarks/results_tables.py"
        )
    assert rt.main(["--check"]) == 0


def test_readme_stays_short():
    lines = rt.README.read_text().splitlines()
    assert len(lines) < rt.MAX_LINES, f"{len(lines)} lines; the issue asks for about 300"


def test_every_table_has_its_block_and_every_row_its_file():
    text = rt.README.read_text()
    blocks = [m["name"] for m in rt.BLOCK.finditer(text)]
    assert sorted(blocks) == sorted(t.name for t in rt.TABLES)
    assert [m["name"] for m in rt.BLOCK.finditer(rt.FILES.read_text())] == ["files"]
    for table in rt.TABLES:
        rows = block_rows(text, table.name)
        assert rows, f"table {table.name} has no rows"
        for row in rows:
            assert len(row) == len(table.header) + 1, row
            named = row[-1].strip("`")
            assert named in table.files and (rt.RESULTS / named).is_file(), row


def test_every_file_has_its_command_in_the_files_table():
    rows = block_rows(rt.FILES.read_text(), "files")
    named = [row[0].strip("`") for row in rows]
    assert named == rt.files_in_order()  # each file once, none missing
    for name, (_, _, date, command) in zip(named, rows):
        assert command.strip("`") == COMMANDS[name]
        assert date != "-" or name in rt.FIXED_DEVICES or name.startswith("validate_"), name
        scripts = re.findall(r"(?:benchmarks|scripts)/[\w/]+\.(?:py|sh)", command)
        assert scripts or " -m xnn " in command, f"{name}: no script in {command}"
        for script in scripts:
            assert (ROOT / script).is_file(), f"{name}: {script} does not exist"


def test_every_results_file_is_in_a_table():
    present = {p.name for p in rt.RESULTS.iterdir() if p.name not in ("README.md", "FILES.md")}
    assert present == rt.files_named()
    assert set(COMMANDS) == present


def test_folding_keeps_every_figure():
    """Each cell of a folded row lists the cells of the rows it folds, in their order."""
    for table in (t for t in rt.TABLES if t.fold is not None):
        for name in table.files:
            rows = table.rows(name, rt.load(name))
            folded = {tuple(r[i] for i in table.fold): r for r in rt.fold(rows, table.fold)}
            seen: dict[tuple[str, ...], int] = {}
            for row in rows:
                key = tuple(row[i] for i in table.fold)
                position = seen[key] = seen.get(key, -1) + 1
                group = sum(tuple(r[i] for i in table.fold) == key for r in rows)
                for cell, merged in zip(row, folded[key]):
                    values = merged.split(" / ") if merged.count(" / ") == group - 1 else []
                    assert merged == cell or values[position] == cell, (table.name, row)
            assert len(folded) <= len(rows)


@pytest.fixture
def copied_results(tmp_path, monkeypatch):
    """The results folder copied to ``tmp_path``, with the module pointed at the copy."""
    copy = tmp_path / "results"
    shutil.copytree(rt.RESULTS, copy)
    monkeypatch.setattr(rt, "RESULTS", copy)
    monkeypatch.setattr(rt, "README", copy / "README.md")
    monkeypatch.setattr(rt, "FILES", copy / "FILES.md")
    return copy


def test_check_fails_when_a_figure_changes(copied_results):
    path = copied_results / "md_compiled_h200.json"
    data = json.loads(path.read_text())
    data["results"][0]["speedup"] = 9.99
    path.write_text(json.dumps(data))
    assert rt.main(["--check"]) == 1
    rt.main([])  # rewrites the README from the files
    assert "| 9.99x |" in (copied_results / "README.md").read_text()
    assert rt.main(["--check"]) == 0


def test_check_fails_when_a_folded_figure_changes(copied_results):
    path = copied_results / "dd_md_cpu16.json"
    data = json.loads(path.read_text())
    data["rows"][1]["atom_steps_per_s"] = 12_345.0  # the 2-rank point of a folded row
    path.write_text(json.dumps(data))
    assert rt.main(["--check"]) == 1
    rt.main([])
    assert " | 50.44k / 12.35k / 173.1k / 307.9k | " in (copied_results / "README.md").read_text()


def test_check_fails_when_a_files_date_changes(copied_results):
    path = copied_results / "calculator_cpu.json"
    data = json.loads(path.read_text())
    data["machine"]["date"] = "2031-01-02T00:00:00"
    path.write_text(json.dumps(data))
    assert rt.main(["--check"]) == 1
    rt.main([])
    rows = block_rows((copied_results / "FILES.md").read_text(), "files")
    assert next(r for r in rows if r[0] == "`calculator_cpu.json`")[2] == "2031-01-02"


def test_check_fails_when_the_readme_grows_too_long(copied_results):
    readme = copied_results / "README.md"
    text = readme.read_text()
    padding = max(rt.MAX_LINES - len(text.splitlines()), 0)
    readme.write_text(text + "prose\n" * padding)
    assert rt.main(["--check"]) == 1


def test_check_fails_when_a_file_is_missing(copied_results):
    (copied_results / "validate_lj_h200x2.json").unlink()
    with pytest.raises(FileNotFoundError, match="validate_lj_h200x2.json is named by a table"):
        rt.main(["--check"])


def test_a_rerun_writes_the_current_file_by_default():
    from benchmarks import common, dd_md

    args = dd_md.parse_args(["--compile", "--ranks", "2", "--sizes", "2000", "--layouts", "domain"])
    assert Path(args.json) == rt.RESULTS / f"dd_md_compiled_{common.device_tag('cpu', 1)}.json"
    assert common.device_tag("cpu", 2) == "gloo2"
    if (common.os.cpu_count() or 1) <= 4:  # the project's CPU machine: the file in the table
        assert Path(args.json).name in rt.files_named()

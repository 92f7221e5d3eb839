"""The tables of benchmarks/results/README.md are what the JSON files beside it say."""

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: benchmarks/
from benchmarks import results_tables as rt  # noqa: E402


def test_readme_tables_equal_the_files():
    text = rt.README.read_text()
    assert rt.rewrite(text, rt.tables()) == text, (
        "benchmarks/results/README.md differs from its JSON files: run "
        "python benchmarks/results_tables.py"
    )
    assert rt.main(["--check"]) == 0


def test_every_table_has_its_block_and_every_row_its_file():
    text = rt.README.read_text()
    blocks = [m["name"] for m in rt.BLOCK.finditer(text)]
    assert sorted(blocks) == sorted(t.name for t in rt.TABLES)
    for table in rt.TABLES:
        rendered = rt.render(table)
        rows = [line for line in rendered.splitlines() if line.startswith("| ")][1:]
        assert rows, f"table {table.name} has no rows"
        for row in rows:
            named = row.rstrip(" |").rsplit("`", 2)[-2]
            assert named in table.files and (rt.RESULTS / named).is_file(), row


def test_every_results_file_is_in_a_table():
    present = {p.name for p in rt.RESULTS.iterdir() if p.name != "README.md"}
    assert present == rt.files_named()


@pytest.fixture
def copied_results(tmp_path, monkeypatch):
    """The results folder copied to ``tmp_path``, with the module pointed at the copy."""
    copy = tmp_path / "results"
    shutil.copytree(rt.RESULTS, copy)
    monkeypatch.setattr(rt, "RESULTS", copy)
    monkeypatch.setattr(rt, "README", copy / "README.md")
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

"""docs/train-your-data.md stays true to the code: its hyperparameter tables are those the
model registry's constructors give (names, defaults, types), for every registered model."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "train-your-data.md"


def _generator():
    spec = importlib.util.spec_from_file_location("docs_hyperparameters",
                                                  ROOT / "scripts" / "docs_hyperparameters.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hyperparameter_tables_match_the_registry():
    gen = _generator()
    on_page = gen.page_tables(PAGE.read_text())
    assert on_page == gen.tables(), (
        "docs/train-your-data.md's tables differ from the models' constructors: run "
        "python scripts/docs_hyperparameters.py --write")


def test_every_model_and_hyperparameter_is_on_the_page():
    """Independent of the generator: each registered model has a table listing each of its
    constructor's arguments with its default."""
    from xnn.models.registry import available_models, model_class

    text = _generator().page_tables(PAGE.read_text())
    for name in available_models():
        assert f"#### `{name}`" in text, name
        table = text.split(f"#### `{name}`", 1)[1].split("####", 1)[0]
        for p in inspect.signature(model_class(name).__init__).parameters.values():
            if p.name == "self":
                continue
            default = "required" if p.default is inspect.Parameter.empty else f"`{p.default!r}`"
            assert f"| `{p.name}` | {default} |" in table, (name, p.name)


def test_readme_and_user_guide_link_the_page():
    assert "docs/train-your-data.md" in (ROOT / "README.md").read_text()
    assert "train-your-data.md" in (ROOT / "docs" / "user-guide.md").read_text()

"""The thermo plot of ``xnn md`` shows the thermostat's target temperature (and the
barostat's target pressure under NPT) as dashed lines; NVE has none."""

from __future__ import annotations

import ase.io
import matplotlib.pyplot as plt
import pytest
from helpers import rattled_argon

from xnn.app.md import run_md
from xnn.config.loader import load_config
from xnn.config.md import MDConfig
from xnn.io import thermo

pytestmark = pytest.mark.usefixtures("one_thread")

LJ = ["model.name=lj", "model.hyperparameters.sigma=3.405", "model.hyperparameters.epsilon=0.0104",
      "model.cutoff=6.5", "output.progress=false", "model.device=cpu"]


@pytest.fixture
def figures(monkeypatch):
    """The figures the run's thermo plot is drawn from (kept open for the test)."""
    made = []
    real = thermo.thermo_figure

    def keep(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(thermo, "thermo_figure", keep)
    monkeypatch.setattr(plt, "close", lambda fig=None: None)
    yield made
    for fig in made:
        plt.close(fig)


def dashed(ax) -> list[float]:
    """The constant values of the dashed horizontal lines of ``ax``."""
    return sorted(float(line.get_ydata()[0]) for line in ax.get_lines()
                  if line.get_linestyle() == "--" and len(set(line.get_ydata())) == 1)


@pytest.mark.parametrize("ensemble, extra, temperature, pressure", [
    ("csvr", ["temperature=40"], [40.0], None),
    ("npt", ["temperature=50", "pressure=2000", "pressure_unit=bar"], [50.0], 0.2),
    ("nve", ["temperature=40"], [], None),
])
def test_thermo_plot_has_dashed_target_lines(tmp_path, figures, ensemble, extra, temperature,
                                             pressure):
    structure = tmp_path / "ar.xyz"
    ase.io.write(structure, rattled_argon())
    cfg = load_config(MDConfig, None, [f"structure={structure}", f"ensemble={ensemble}",
                                       "steps=4", "timestep=2", f"output.dir={tmp_path / 'md'}",
                                       *LJ, *extra])
    out = run_md(cfg)
    assert (out / "thermo.png").is_file()
    (fig,) = figures
    t_ax, _, p_ax, _ = fig.axes
    assert t_ax.get_ylabel() == "T (K)" and p_ax.get_ylabel() == "P (GPa)"
    assert dashed(t_ax) == pytest.approx(temperature)
    assert dashed(p_ax) == (pytest.approx([pressure]) if pressure is not None else [])

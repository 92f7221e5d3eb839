"""The applications: config → objects → parallelize → run → files.

* :mod:`xnn.app.train` — ``train(cfg, reducer)`` and ``run_train(cfg)`` (``xnn train``), with
  :mod:`~xnn.app.train_data` (datasets from the ``data`` section), :mod:`~xnn.app.train_model`
  (the model from the ``model`` section) and :mod:`~xnn.app.train_finish` (final weights,
  test metrics, plots, ``summary.json``).
* :mod:`xnn.app.md` — ``run_md(config)`` (``xnn md``); :mod:`xnn.app.relax` —
  ``run_relax(config)`` (``xnn relax``); both share :mod:`~xnn.app.md_common` (set-up, the
  launch on several ranks through :func:`xnn.distributed.parallelize.parallelize_md`) and
  :mod:`~xnn.app.md_setup` (potential, structure, velocities and integrator arguments from
  the config).
* :mod:`xnn.app.validate` — ``run_validate(options)`` (``xnn validate``).
* :mod:`xnn.app.demo` — ``demo_train`` and ``demo_md`` (``xnn demo``).

The only layer that knows all the others; the libraries below it (``training``,
``dynamics``, ``models``, ...) import neither ``xnn.config``, ``xnn.io`` nor
``xnn.app``. The command-line interface (:mod:`xnn.cli`) is a thin shell over it.
"""

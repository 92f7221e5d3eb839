"""The applications: config → objects → parallelize → run → files.

* :mod:`xnn.app.train` — ``train(cfg, reducer)`` and ``run_train(cfg)`` (``xnn train``), with
  :mod:`~xnn.app.train_data` (datasets from the ``data`` section), :mod:`~xnn.app.train_model`
  (the model from the ``model`` section) and :mod:`~xnn.app.train_finish` (final weights,
  test metrics, plots, ``summary.json``).
* :mod:`xnn.app.md` — ``run_md(config)`` (``xnn md``); :mod:`xnn.app.relax` —
  ``run_relax(config)`` (``xnn relax``); both share :mod:`~xnn.app.md_common` (set-up, the
  launch on several ranks through :func:`xnn.distributed.entries.parallelize_md`) and
  :mod:`~xnn.app.md_setup` (potential, structure, velocities and integrator arguments from
  the config).
* :mod:`xnn.app.validate` — ``run_validate(options)`` (``xnn validate``), with
  :mod:`~xnn.app.model_spec` (``--model lj:sigma=2.3`` specs, built on every rank).
* :mod:`xnn.app.evaluate` — ``run_eval(options)`` (``xnn eval``); :mod:`xnn.app.export` —
  ``export_file`` (``xnn export``); :mod:`xnn.app.data` — the ``xnn data`` subcommands.
* :mod:`xnn.app.demo` — ``run_demo`` (``xnn demo``: ``demo_train``, ``demo_md`` and the
  Lennard-Jones relaxation).
* :mod:`xnn.app.modes` — the one translation of ``parallel.mode`` / ``--mode`` words to the
  words today's library entries take (transitional).

The only layer that knows all the others; the libraries below it (``training``,
``dynamics``, ``models``, ...) import neither ``xnn.config``, ``xnn.io`` nor
``xnn.app``. The command-line interface (:mod:`xnn.cli`) is a thin shell over it.
"""

"""The ``mori`` command line: ``simulate``, ``policies``, ``presets`` and ``--version``.

Entry point: :func:`mori.cli.main.main`. The options of ``mori simulate`` are declared once
in :mod:`mori.cli.options`; both the argument parser and the TOML config loader
(:mod:`mori.cli.config_file`) are built from that table.
"""

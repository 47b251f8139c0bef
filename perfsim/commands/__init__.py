"""Subcommands beyond predict and profiles, one module each.

A module here defines `register(subparsers)`, which adds its parser (with `set_defaults(run=...)`),
and keeps heavy imports (torch, plotly, scipy, networkx) inside the functions that run the
command, so that `perfsim predict` stays fast. cli.py discovers the modules by name.
"""

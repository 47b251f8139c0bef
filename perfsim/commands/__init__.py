"""The commands, one module each (perfsim/cli.py lists them by name), and flags.py, the flags they share.

A command module defines `register(subparsers)`, which adds its parser (with `set_defaults(run=...)`),
and keeps heavy imports (torch, plotly, scipy, networkx) inside the functions that run the
command; perfsim/cli.py imports only the module of the command named, so `perfsim predict` stays fast.
"""

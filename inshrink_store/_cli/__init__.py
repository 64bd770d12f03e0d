"""The ``inshrink`` command line (the CLI layer, the package's top layer): verbs on a store
URL, calling the public API only. ``pyproject.toml`` names :func:`main` as the entry point;
``python -m inshrink_store._cli`` runs it too (``__main__``).

The package, by module:

- ``core``: the typer app, global options (``--timeout``, ``--version``), shared option
  types and output helpers, and :func:`main`, which turns errors into one line
- ``opening``: from a store URL to a store (what a URL names, a missing bucket, a damaged
  ``inshrink.json``)
- ``versions``: ``init``, ``log``, ``ls``, ``show``, ``diff``
- ``transfer``: ``import`` and ``export`` (checkpoint files in and out)
- ``refs``: ``tags``, ``tag``, ``branch``
- ``admin``: ``verify``, ``gc``, ``du``
- ``demo``: ``demo``

The commands are registered here, in the order ``inshrink --help`` lists them (typer keeps
the order of registration): a new command is a function in the module of its group and a
line below.
"""

from __future__ import annotations

from inshrink_store._cli import admin, demo, refs, transfer, versions
from inshrink_store._cli.core import DEFAULT_TIMEOUT, TIMEOUT_ENV, app, main

__all__ = ["DEFAULT_TIMEOUT", "TIMEOUT_ENV", "app", "main"]

app.command()(versions.init)
app.command("import")(transfer.import_)
app.command()(versions.log)
app.command("ls")(versions.ls)
app.command()(versions.show)
app.command()(versions.diff)
app.command()(transfer.export)
app.command()(refs.tags)
app.command()(refs.tag)
app.command()(refs.branch)
app.command()(admin.verify)
app.command()(admin.gc)
app.command()(admin.du)
app.command()(demo.demo)

"""The commands on a store's names (the CLI layer, the package's top layer): ``tags``,
``tag`` and ``branch``: list, create or delete tags and branches.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

import inshrink_store as ins
from inshrink_store._cli.core import DeleteOpt, JsonOpt, _json, _row, _say, out
from inshrink_store._cli.opening import _open
from inshrink_store.errors import InshrinkError


def _check_name_mode(kind: str, name: str | None, ref: str | None, delete: bool) -> None:
    if delete and name is None:
        raise typer.BadParameter(f"Expected the {kind} NAME to delete. Got none instead; "
                                 f"run `inshrink {kind} URL NAME --delete`.")
    if delete and ref is not None:
        raise typer.BadParameter(f"Expected no REF with --delete. Got {ref!r} instead; "
                                 f"run `inshrink {kind} URL NAME --delete` alone.")


def _list_tags(repo: ins.Repository, as_json: bool) -> None:
    tags = repo.tags()
    if as_json:
        _json([{"name": n, "snapshot": sid} for n, sid in sorted(tags.items())])
        return
    table = Table("tag", "snapshot")
    for n, sid in sorted(tags.items()):
        _row(table, n, sid)
    out.print(table)


def tags(url: str, as_json: JsonOpt = False) -> None:
    """List the tags (the same as `inshrink tag URL`)."""
    _list_tags(_open(url), as_json)


def tag(
    url: str,
    name: Annotated[str | None, typer.Argument(help="Tag to create or delete; none lists the tags.")] = None,
    ref: Annotated[str | None, typer.Argument(help="Version to tag (default: main).")] = None,
    delete: DeleteOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Name a version (tags are write-once), delete a tag with -d, or list tags (no NAME)."""
    _check_name_mode("tag", name, ref, delete)
    repo = _open(url)
    if name is None:
        _list_tags(repo, as_json)
        return
    if delete:
        sid = repo.delete_tag(name)
        if as_json:
            _json({"name": name, "snapshot": sid, "deleted": True})
        else:
            _say(out, "deleted tag ", name, f" (was -> {sid})")
        return
    sid = repo.tag(name, ref or "main")
    if as_json:
        _json({"name": name, "snapshot": sid, "deleted": False})
    else:
        _say(out, name, f" -> {sid}")


def branch(
    url: str,
    name: Annotated[str | None, typer.Argument(help="Branch to create or delete; none lists the branches.")] = None,
    ref: Annotated[str | None, typer.Argument(help="Version the new branch starts at (default: main).")] = None,
    delete: DeleteOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """List branches (no NAME), create NAME at REF, or delete NAME with -d."""
    _check_name_mode("branch", name, ref, delete)
    repo = _open(url)
    if name is None:
        rows = []
        for n, head in sorted(repo.branches().items()):
            row: dict[str, Any] = {"name": n, "head": head, "step": None, "time": None, "message": None}
            try:
                info = repo.snapshot(head)
                row.update(step=info.step, time=info.time, message=info.message)
            except (InshrinkError, OSError, ValueError) as exc:  # a dangling head: list it, say why
                row["error"] = str(exc)
            rows.append(row)
        if as_json:
            _json(rows)
            return
        table = Table("branch", "head", "step", "time", "message")
        for r in rows:
            missing = "error" in r
            _row(table, r["name"], r["head"][:12], "-" if r["step"] is None else r["step"],
                 "-" if missing else str(r["time"])[:19].replace("T", " "),
                 "(head snapshot unreadable: run `inshrink verify`)" if missing else r["message"])
        out.print(table)
        return
    if delete:
        sid = repo.delete_branch(name)
        if as_json:
            _json({"name": name, "head": sid, "deleted": True})
        else:
            _say(out, "deleted branch ", name, f" (was at {sid})")
        return
    sid = repo.create_branch(name, ref or "main")
    if as_json:
        _json({"name": name, "head": sid, "deleted": False})
    else:
        _say(out, "branch ", name, f" -> {sid}")

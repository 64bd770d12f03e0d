"""Branches and tags as write-once files; resolving ref expressions to snapshot ids.

A branch is a folder of files ``refs/branches/<name>/<seq>`` each holding one
snapshot id; the head is the highest ``seq``. Advancing a branch is creating the
next ``seq`` exclusively, the one atomic step every fsspec backend offers, so two
writers can never both win. Tags are single write-once files.
"""

from __future__ import annotations

import re

from inshrink_store.errors import FormatError
from inshrink_store.layout import branch_ref_path, parse_branch_listing, tag_path  # noqa: F401

# always used with fullmatch: "$" would also match before a trailing newline
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SEQ_WIDTH = 12
_EXPR = re.compile(r"(?P<base>[^~^\s]+)(?P<ops>(?:~[0-9]*|\^)*)")
_MAX_BACK = 1 << 20  # "main~N" walks N parents: far above any history, bounded


def check_name(name: str, kind: str) -> str:
    """Branch and tag names: letters, digits, '.', '_', '-'; no slashes, no '..'."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise FormatError(
            f"Expected a {kind} name of letters, digits, '.', '_' or '-' (no '/' or '..'). "
            f"Got {name!r} instead."
        )
    return name


def parse_expression(expr: str) -> tuple[str, int]:
    """``main~3`` -> ("main", 3); ``main^^`` -> ("main", 2); ``abc123`` -> ("abc123", 0)."""
    if not isinstance(expr, str):
        raise FormatError(f"Expected a ref such as 'main', 'main~3', a tag or a snapshot id. Got {expr!r}.")
    match = _EXPR.fullmatch(expr.strip())
    if not match:
        raise FormatError(
            f"Expected a ref such as 'main', 'main~3', a tag or a snapshot id. Got {expr!r:.80} instead."
        )
    back = 0
    for op in re.findall(r"~[0-9]*|\^", match.group("ops")):
        back += 1 if op in ("^", "~") else int(op[1:]) if len(op) < 12 else _MAX_BACK + 1
    if back > _MAX_BACK:
        raise FormatError(
            f"Expected at most {_MAX_BACK} steps back in ref {expr!r:.80}. Got {back} instead; "
            "name the version by its snapshot id."
        )
    return match.group("base"), back

"""Nested training state <-> flat ``{path: array}`` plus a JSON skeleton, without pickle.

Optimizer state is nested dicts (with int keys), lists, tuples and Python scalars
around tensors. The arrays become zarr arrays at '/'-joined paths; everything else
becomes a JSON skeleton that records types exactly (int vs str keys, tuple vs list,
floats as hex so NaN, inf and -0.0 survive), stored in the root group's attributes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

from inshrink_store.errors import FormatError

Leaf = Any  # an array-like the caller recognises


def _component(key: object, path: str) -> str:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise FormatError(
            f"Expected str or int keys in the state. Got {type(key).__name__} key {key!r} at {path or '/'!r}."
        )
    text = str(key)
    if (not text or text in (".", "..") or "/" in text or "\\" in text or text.startswith("__")
            or text == "zarr.json"):
        raise FormatError(
            f"Expected a state key usable as a tensor name. Got {text!r} at {path or '/'!r} instead: "
            "names may not be empty, '.', '..', start with '__' or contain '/' or '\\'; rename it."
        )
    return text


def flatten(obj: Any, is_leaf: Callable[[Any], bool], leaf_id: Callable[[Any], Any] | None = None,
            prefix: str = "") -> tuple[dict[str, Leaf], Any]:
    """Split ``obj`` into leaves by path and a JSON-native skeleton.

    ``leaf_id`` returns an identity for aliasing (tied tensors): a leaf with an identity seen
    before is stored once and the skeleton points the second path at the first.
    """
    leaves: dict[str, Leaf] = {}
    seen: dict[Any, str] = {}

    def walk(node: Any, path: str) -> Any:
        if is_leaf(node):
            ident = leaf_id(node) if leaf_id else None
            if ident is not None and ident in seen:
                return {"__alias__": seen[ident]}
            leaves[path] = node
            if ident is not None:
                seen[ident] = path
            return {"__array__": path}
        if isinstance(node, dict):
            items = []
            for key, value in node.items():
                comp = _component(key, path)
                items.append([key if isinstance(key, int) else comp,
                              walk(value, f"{path}/{comp}" if path else comp)])
            if any(isinstance(k, int) for k, _ in items) and len({str(k) for k, _ in items}) != len(items):
                raise FormatError(f"Expected distinct keys at {path or '/'!r}. Got 1 and '1' both.")
            return {"__dict__": items}
        if isinstance(node, (list, tuple)):
            kind = "__tuple__" if isinstance(node, tuple) else "__list__"
            return {kind: [walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(node)]}
        return _scalar(node, path)

    skeleton = walk(obj, prefix)
    return leaves, skeleton


def _scalar(value: Any, path: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return {"__int__": str(value)} if abs(value) >= 2**53 else value
    if isinstance(value, float):
        if math.isnan(value):
            # float.hex() writes every NaN as 'nan': keep its sign and payload as raw bits
            return {"__float_bits__": struct.pack("<d", value).hex()}
        return {"__float__": value.hex()}  # exact for every other float, inf and -0.0 included
    raise FormatError(
        f"Expected tensors, dicts, lists, tuples, str, int, float, bool or None in the state. "
        f"Got {type(value).__name__} at {path or '/'!r} instead (no pickle: convert it first)."
    )


def unflatten(skeleton: Any, leaves: dict[str, Leaf]) -> Any:
    """Inverse of :func:`flatten`; aliases resolve to the very same leaf object."""
    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "__array__" in node:
                return _leaf(node["__array__"])
            if "__alias__" in node:
                return _leaf(node["__alias__"])
            if "__dict__" in node:
                return {k: walk(v) for k, v in node["__dict__"]}
            if "__list__" in node:
                return [walk(v) for v in node["__list__"]]
            if "__tuple__" in node:
                return tuple(walk(v) for v in node["__tuple__"])
            if "__float__" in node:
                return float.fromhex(node["__float__"])
            if "__float_bits__" in node:
                return _float_from_bits(node["__float_bits__"])
            if "__int__" in node:
                return int(node["__int__"])
            raise FormatError(f"Expected a known skeleton node. Got keys {sorted(node)} instead.")
        return node

    def _leaf(path: str) -> Leaf:
        if path not in leaves:
            raise FormatError(f"Expected a tensor at {path!r} for the saved structure. Got none instead.")
        return leaves[path]

    return walk(skeleton)


def _float_from_bits(text: Any) -> float:
    try:
        raw = bytes.fromhex(text)
        if len(raw) != 8:
            raise ValueError("not 8 bytes")
    except (TypeError, ValueError) as exc:
        raise FormatError(
            f"Expected 16 hex digits (a float64's bytes) in a __float_bits__ node. Got {text!r} instead."
        ) from exc
    return float(struct.unpack("<d", raw)[0])

"""Nested training state <-> flat ``{path: array}`` plus a JSON skeleton, without pickle.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

Optimizer state is nested dicts (with int keys), lists, tuples and Python scalars
around tensors. The arrays become zarr arrays at '/'-joined paths; everything else
becomes a JSON skeleton that records types exactly (int vs str keys, tuple vs list,
floats as hex so NaN, inf and -0.0 survive), stored in the root group's attributes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from typing import Any

from inshrink_store.errors import FormatError

Leaf = Any  # an array-like the caller recognises

#: the root group attribute holding a saved state's skeleton
STRUCTURE_ATTR = "inshrink_structure"
#: the root group attribute mapping optimizer parameter indices to parameter names
#: (``{"0": "encoder.layer.0.attention.self.query.weight"}``), written where the saver knew
#: the model (the Checkpointer); see :func:`optimizer_param_names` for the other source
PARAM_NAMES_ATTR = "inshrink_param_names"
#: the key of every zarr v3 node's metadata document, so never a name a state key may take;
#: the one spelling of it (``index.METADATA_KEY`` re-exports it to the layers above)
METADATA_KEY = "zarr.json"


def _component(key: object, path: str) -> str:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise FormatError(
            f"Expected str or int keys in the state. Got {type(key).__name__} key {key!r} at {path or '/'!r}."
        )
    text = str(key)
    if (not text or text in (".", "..") or "/" in text or "\\" in text or text.startswith("__")
            or text == METADATA_KEY):
        raise FormatError(
            f"Expected a state key usable as a tensor name. Got {text!r} at {path or '/'!r} instead: "
            "names may not be empty, '.', '..', start with '__' or contain '/' or '\\'; rename it."
        )
    return text


def flatten(obj: Any, is_leaf: Callable[[Any], bool], leaf_id: Callable[[Any], Any] | None = None,
            prefix: str = "", leaf_tag: Callable[[Any], Mapping[str, Any]] | None = None,
            tuple_types: Mapping[type, str] | None = None) -> tuple[dict[str, Leaf], Any]:
    """Split ``obj`` into leaves by path and a JSON-native skeleton.

    ``leaf_id`` returns an identity for aliasing (tied tensors): a leaf with an identity seen
    before is stored once and the skeleton points the second path at the first.
    ``leaf_tag`` adds keys to a leaf's node (``{"__numpy__": True}``: the caller's kind of
    array, which its reader must give back). ``tuple_types`` names tuple subclasses whose
    type is recorded (``{torch.Size: "torch.Size"}``, as ``"__type__"``) so that
    :func:`unflatten` rebuilds them; any other tuple subclass comes back a tuple.
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
            return {"__array__": path, **(leaf_tag(node) if leaf_tag else {})}
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
            out: dict[str, Any] = {kind: [walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(node)]}
            if tuple_types and type(node) in tuple_types:
                out["__type__"] = tuple_types[type(node)]
            return out
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
        f"Expected tensors, numpy arrays, dicts, lists, tuples, str, int, float, bool or None in the state. "
        f"Got {type(value).__name__} at {path or '/'!r} instead (no pickle: convert it first)."
    )


def unflatten(skeleton: Any, leaves: dict[str, Leaf],
              tuple_types: Mapping[str, Callable[[tuple[Any, ...]], Any]] | None = None) -> Any:
    """Inverse of :func:`flatten`; aliases resolve to the very same leaf object.
    ``tuple_types`` rebuilds the tuples whose ``"__type__"`` it names; any other type name is
    a FormatError (a reader that cannot give the saved type back says so)."""
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
                items = tuple(walk(v) for v in node["__tuple__"])
                return items if "__type__" not in node else _typed(node["__type__"], items)
            if "__float__" in node:
                return float.fromhex(node["__float__"])
            if "__float_bits__" in node:
                return _float_from_bits(node["__float_bits__"])
            if "__int__" in node:
                return int(node["__int__"])
            raise FormatError(f"Expected a known skeleton node. Got keys {sorted(node)} instead.")
        return node

    def _typed(name: Any, items: tuple[Any, ...]) -> Any:
        build = (tuple_types or {}).get(name) if isinstance(name, str) else None
        if build is None:
            raise FormatError(
                f"Expected a tuple type this reader can rebuild ({sorted(tuple_types or {})}). Got "
                f"{name!r} instead; read the state with inshrink_store.torch.load_state.")
        return build(items)

    def _leaf(path: str) -> Leaf:
        if path not in leaves:
            raise FormatError(f"Expected a tensor at {path!r} for the saved structure. Got none instead.")
        return leaves[path]

    return walk(skeleton)


def _children(node: Any) -> dict[str, Any]:
    """A dict node's children by key as text (``{}`` for any other node)."""
    items = node.get("__dict__") if isinstance(node, dict) else None
    return {str(k): v for k, v in items if isinstance(k, (str, int))} if isinstance(items, list) else {}


def _items(node: Any) -> list[Any]:
    """A list node's items (big ints, stored as ``__int__`` nodes, decoded)."""
    items = node.get("__list__") if isinstance(node, dict) else None
    return [unflatten(v, {}) if isinstance(v, dict) and "__int__" in v else v for v in items or []]


def optimizer_param_names(skeleton: Any) -> dict[int, str]:
    """Parameter index -> name from the ``param_names`` torch's optimizers put in each of
    ``optimizer/param_groups`` when built from ``model.named_parameters()``; ``{}`` when the
    state has none (an optimizer built from ``model.parameters()`` does not say)."""
    names: dict[int, str] = {}
    for group in _items(_children(_children(skeleton).get("optimizer")).get("param_groups")):
        params, given = _items(_children(group).get("params")), _items(_children(group).get("param_names"))
        if len(params) == len(given):
            names.update({i: n for i, n in zip(params, given, strict=True)
                          if isinstance(i, int) and not isinstance(i, bool) and isinstance(n, str)})
    return names


def tagged_leaves(skeleton: Any, tag: str) -> set[str]:
    """The paths of the leaves whose node carries ``tag`` (see ``leaf_tag`` of :func:`flatten`)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "__array__" in node:
                if node.get(tag):
                    found.add(node["__array__"])
                return
            for key in ("__dict__", "__list__", "__tuple__"):
                for child in node.get(key) or []:
                    walk(child[1] if key == "__dict__" else child)

    walk(skeleton)
    return found


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

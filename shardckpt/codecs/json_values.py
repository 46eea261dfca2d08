"""Typed JSON for a tree's structure and plain values, so they survive formats without pickles.

A tuple stays a tuple, an int stays an int, an int dict key stays an int, and NaN or
infinity stay floats; JSON alone would lose each of these. Tensors become named holes.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Mapping

from shardckpt.state.tree import TensorMeta, _enters, dotted


class UnencodableValue(ValueError):
    """A value with no typed-JSON form (the message names its path and type)."""


def encode_tree(
    tree: object, name_of: Callable[[tuple, TensorMeta], str], path: tuple = ()
) -> object:
    """Return the typed-JSON form of ``tree``; tensor leaves become ``{"tensor": name}``."""
    if isinstance(tree, Mapping):
        return {
            "dict": [
                [_encode_key(k, path), encode_tree(v, name_of, path + (k,))]
                for k, v in tree.items()
            ]
        }
    if path and _enters(tree):
        return {"list": [encode_tree(v, name_of, path + (i,)) for i, v in enumerate(tree)]}  # type: ignore[arg-type]
    if isinstance(tree, TensorMeta):
        return {"tensor": name_of(path, tree)}
    return {"value": encode_value(tree, path)}


def decode_tree(node: object, tensor: Callable[[str], object]) -> object:
    """Return the tree encoded by ``encode_tree``, with ``tensor(name)`` for each hole."""
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"malformed tree node {node!r}")
    ((kind, body),) = node.items()
    if kind == "dict":
        return {decode_value(k): decode_tree(v, tensor) for k, v in body}
    if kind == "list":
        return [decode_tree(v, tensor) for v in body]
    if kind == "tensor":
        return tensor(body)
    if kind == "value":
        return decode_value(body)
    raise ValueError(f"unknown tree node kind {kind!r}")


def _encode_key(key: object, path: tuple) -> object:
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        return key
    return encode_value(key, path)


def encode_value(value: object, path: tuple = ()) -> object:
    """Return ``value`` as typed JSON; raises ``UnencodableValue`` for other types."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, list):
        return [encode_value(v, path) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v, path) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[encode_value(k, path), encode_value(v, path)] for k, v in value.items()]}
    if isinstance(value, bytes):
        # torchtitan keeps its dataloader state as pickled bytes.
        return {"bytes": base64.b64encode(value).decode("ascii")}
    raise UnencodableValue(
        f"value at '{dotted(path)}' is a {type(value).__name__}, which has no JSON form"
    )


def decode_value(node: object) -> object:
    """Return the Python value encoded by ``encode_value``."""
    if isinstance(node, list):
        return [decode_value(v) for v in node]
    if isinstance(node, dict):
        ((kind, body),) = node.items()
        if kind == "tuple":
            return tuple(decode_value(v) for v in body)
        if kind == "dict":
            return {decode_value(k): decode_value(v) for k, v in body}
        if kind == "float":
            return float(body)
        if kind == "bytes":
            return base64.b64decode(body)
        raise ValueError(f"unknown value kind {kind!r}")
    return node

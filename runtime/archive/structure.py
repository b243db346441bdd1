"""The shape of a sample of an archive compiled from a user's own Dataset or function
(dlop.compiler.custom): a dict of fields or a tuple of them, nested one level at
most, recorded in index.json's ``metadata.structure``. ``ds[i]`` gives each sample
back in that shape: tensors for arrays, Python int/float/bool for scalars, str and
bytes as they were. A batch in that shape keeps the fields' batched forms: ``[B, ...]``
tensors (scalars too), lists for str and bytes, and for a ragged field its padded
tensor, with ``<name>_lengths`` beside it in a dict and as a ``(padded, lengths)`` pair
in a tuple.

The structure comes from an archive, so it is checked like any of its bytes: every
node's type, every key, every field named once and held by the archive.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from dlop.formats import Field, FormatError

_LEAVES = ("array", "int", "float", "bool", "str", "bytes")
_SCALARS = ("int", "float", "bool")  # 0-d array fields, read back as Python values
MAX_FIELDS = 1 << 16


class Structure:
    """A checked ``metadata.structure``; ``sample`` and ``batch`` shape a field dict."""

    def __init__(self, where: str, obj: Any, fields: Mapping[str, Field]) -> None:
        self.where = where
        self.names: dict[str, None] = {}  # every field it names, in order
        if isinstance(obj, dict) and ("field" in obj or obj.get("type") == "leaf"):
            self._bad("the top is a single field, not a dict or a tuple")
        self.tree = self._node(obj, 0, fields)
        leaves = [c[1] for c in self.tree[1] if c[1][0] == "leaf"]
        # a dict of top-level fields only: a batch keyed by field name is already its shape,
        # and a sample too when none reads back as a Python scalar
        self.flat = self.tree[0] == "dict" and len(leaves) == len(self.tree[1])
        self.sample_as_is = self.flat and all(leaf[2] not in _SCALARS for leaf in leaves)

    @classmethod
    def of(
        cls, where: str, metadata: Mapping[str, Any], fields: Mapping[str, Field]
    ) -> Structure | None:
        """The archive's structure, or None when it records none."""
        obj = metadata.get("structure")
        return None if obj is None else cls(where, obj, fields)

    def _bad(self, problem: str) -> NoReturn:
        raise FormatError(self.where, f"metadata.structure: {problem}")

    def _node(self, obj: Any, depth: int, fields: Mapping[str, Field]) -> tuple[Any, ...]:
        if not isinstance(obj, dict):
            self._bad(f"a node is a {type(obj).__name__}, not an object")
        if "field" in obj:
            name, back = obj.get("field"), obj.get("value")
            if not isinstance(name, str) or name not in fields:
                self._bad(f"names field {name!r:.80}, which the archive does not hold")
            if back not in _LEAVES:
                self._bad(f"field {name!r} reads back as {back!r:.40}, not one of {_LEAVES}")
            stored = fields[name]
            kind = back if back in ("str", "bytes") else "array"
            if stored.kind != kind or (back in _SCALARS and stored.shape != ()):
                self._bad(
                    f"field {name!r} reads back as {back}, but it holds {stored.kind} "
                    f"{list(stored.shape)}"
                )
            if name in self.names:
                self._bad(f"names field {name!r} twice")
            if len(self.names) >= MAX_FIELDS:
                self._bad(f"more than {MAX_FIELDS} fields")
            self.names[name] = None
            return ("leaf", name, back, stored.kind == "array" and stored.ragged)
        kind, children = obj.get("type"), obj.get("fields")
        if kind not in ("dict", "tuple") or not isinstance(children, list) or not children:
            self._bad(f"a node of type {kind!r:.40} (a dict or tuple with fields is expected)")
        if depth >= 2:
            self._bad("nested more than one level")
        out = []
        for n, child in enumerate(children):
            key = child.get("key") if isinstance(child, dict) else None
            if not isinstance(key, str) or (kind == "tuple" and key != str(n)):
                self._bad(f"key {key!r:.40} at position {n} of a {kind}")
            out.append((key, self._node(child, depth + 1, fields)))
        if kind == "dict" and len({k for k, _ in out}) != len(out):
            self._bad("a dict names a key twice")
        return (kind, out)

    def sample(self, values: Mapping[str, Any]) -> Any:
        """One sample (field -> tensor, str or bytes) in its shape."""
        return values if self.sample_as_is else self._shape(self.tree, values, False)

    def batch(self, values: Mapping[str, Any]) -> Any:
        """A batch (field -> batched value, ``<name>_lengths`` for ragged ones) in its shape:
        ``values`` itself when the samples are a flat dict."""
        return values if self.flat else self._shape(self.tree, values, True)

    def _shape(self, node: tuple[Any, ...], values: Mapping[str, Any], batched: bool) -> Any:
        if node[0] == "leaf":
            _, name, back, ragged = node
            value = values[name]
            if not batched:
                return value.item() if back in _SCALARS else value
            return (value, values[f"{name}_lengths"]) if ragged else value
        kind, children = node
        if kind == "tuple":
            return tuple(self._shape(child, values, batched) for _, child in children)
        out: dict[str, Any] = {}
        for key, child in children:
            shaped = self._shape(child, values, batched)
            if batched and isinstance(shaped, tuple) and child[0] == "leaf":
                out[key], out[f"{key}_lengths"] = shaped
            else:
                out[key] = shaped
        return out

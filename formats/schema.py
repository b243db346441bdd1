"""Field definitions: name, kind, dtype, per-sample shape and codec (SPEC.md §3)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .codecs import Codec, Raw, codec_from_json, parse_codec
from .constants import DTYPES, KINDS, MAX_DIM, MAX_NAME_CHARS, MAX_NDIM, MAX_SAMPLE_BYTES
from .errors import SchemaError

_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")

Shape = tuple[int | None, ...]


@dataclass(frozen=True)
class Field:
    """One column of an archive.

    ``shape`` is the per-sample shape; ``None`` marks a dimension that varies per
    sample (a ragged field). ``bytes`` and ``str`` fields are ragged ``u8`` of
    shape ``(None,)``.
    """

    name: str
    dtype: str = "u8"
    shape: Shape = ()
    kind: str = "array"
    codec: Codec = field(default_factory=Raw)
    meaning: str = ""
    units: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise SchemaError(
                f"field name {self.name!r} must be 1-{MAX_NAME_CHARS} characters of A-Z a-z 0-9 _ . -"
            )
        if len(self.name) > MAX_NAME_CHARS:
            raise SchemaError(f"field name {self.name[:40]!r}... is longer than {MAX_NAME_CHARS}")
        if self.kind not in KINDS:
            raise SchemaError(f"field {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.dtype not in DTYPES:
            raise SchemaError(
                f"field {self.name!r}: dtype {self.dtype!r} is not one of {sorted(DTYPES)}"
            )
        shape = tuple(self.shape)
        for dim in shape:
            if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 0):
                raise SchemaError(
                    f"field {self.name!r}: shape {list(shape)} must hold non-negative ints or None"
                )
        if len(shape) > MAX_NDIM:
            raise SchemaError(
                f"field {self.name!r}: {len(shape)} dimensions, at most {MAX_NDIM} are allowed"
            )
        for dim in shape:
            if dim is not None and dim > MAX_DIM:
                raise SchemaError(
                    f"field {self.name!r}: dimension {dim} of shape {list(shape)} exceeds {MAX_DIM}"
                )
        object.__setattr__(self, "shape", shape)
        if self.kind != "array" and (self.dtype != "u8" or shape != (None,)):
            raise SchemaError(
                f"field {self.name!r}: {self.kind} fields are dtype 'u8' with shape (None,); "
                f"got {self.dtype!r} {list(shape)}"
            )
        if isinstance(self.codec, str):
            object.__setattr__(self, "codec", parse_codec(self.codec))
        if self.footprint_bytes > MAX_SAMPLE_BYTES:
            raise SchemaError(
                f"field {self.name!r}: a sample of shape {list(shape)} {self.dtype} holds more "
                f"than {MAX_SAMPLE_BYTES} bytes (zero dimensions count as 1)"
            )

    @classmethod
    def bytes_(cls, name: str, codec: Codec | str = "raw", **kw: str) -> Field:
        return cls(name, "u8", (None,), "bytes", _codec(codec), **kw)

    @classmethod
    def str_(cls, name: str, codec: Codec | str = "raw", **kw: str) -> Field:
        return cls(name, "u8", (None,), "str", _codec(codec), **kw)

    @property
    def np_dtype(self) -> np.dtype[Any]:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return int(self.np_dtype.itemsize)

    @property
    def ragged(self) -> bool:
        return any(d is None for d in self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def sample_bytes(self) -> int:
        """Bytes per sample of a fixed field."""
        if self.ragged:
            raise SchemaError(f"field {self.name!r} is ragged: samples have no fixed size")
        return math.prod(d for d in self.shape if d is not None) * self.itemsize

    @property
    def footprint_bytes(self) -> int:
        """Bytes per sample with every zero dimension counted as 1 (SPEC.md §8), over the
        fixed dimensions: what bounds the arrays numpy is asked to describe."""
        return footprint_bytes(self.shape, self.itemsize)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "codec": self.codec.to_json(),
            "meaning": self.meaning,
            "units": self.units,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = "field") -> Field:
        """Build from a header/index entry; raises SchemaError on any bad key."""
        if not isinstance(obj, Mapping):
            raise SchemaError(f"{where}: expected an object, got {type(obj).__name__}")
        name = _get(obj, "name", str, where)
        where = f"{where} {name!r}"
        shape = _get(obj, "shape", list, where)
        if len(shape) > MAX_NDIM:
            raise SchemaError(f"{where}: {len(shape)} dimensions, at most {MAX_NDIM} are allowed")
        for dim in shape:
            if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
                raise SchemaError(f"{where}: shape entry {dim!r} is not an integer or null")
        return cls(
            name=name,
            dtype=_get(obj, "dtype", str, where),
            shape=tuple(shape),
            kind=_get(obj, "kind", str, where),
            codec=codec_from_json(_get(obj, "codec", dict, where), where),
            meaning=obj.get("meaning", "") if isinstance(obj.get("meaning", ""), str) else "",
            units=obj.get("units", "") if isinstance(obj.get("units", ""), str) else "",
        )


def footprint_bytes(shape: Sequence[int | None], itemsize: int) -> int:
    """Product of the known dimensions (zeros and unknowns counted as 1) times itemsize."""
    return math.prod(max(d, 1) for d in shape if d is not None) * itemsize


def _codec(codec: Codec | str) -> Codec:
    return parse_codec(codec) if isinstance(codec, str) else codec


def _get(obj: Mapping[str, Any], key: str, typ: type, where: str) -> Any:
    if key not in obj:
        raise SchemaError(f"{where}: missing key {key!r}")
    value = obj[key]
    if (isinstance(value, bool) and typ is not bool) or not isinstance(value, typ):
        raise SchemaError(
            f"{where}: key {key!r} should be {typ.__name__}, got {type(value).__name__}"
        )
    return value


def check_schema(fields: Sequence[Field]) -> dict[str, Field]:
    """Returns fields by name; rejects duplicates."""
    by_name: dict[str, Field] = {}
    for f in fields:
        if not isinstance(f, Field):
            raise SchemaError(f"expected Field, got {type(f).__name__}")
        if f.name in by_name:
            raise SchemaError(f"field name {f.name!r} appears twice in the schema")
        by_name[f.name] = f
    return by_name

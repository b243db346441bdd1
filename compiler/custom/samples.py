"""What a sample of one's own Dataset may be, and the schema its items make.

A sample is a dict of str -> value, or a tuple/list of values (fields named
``0``, ``1``, ...); a value may itself be such a dict or tuple of leaves (one level
of nesting: field ``"1.a"``). A leaf is a numpy array, a torch tensor, a Python or
numpy scalar, a str, bytes, or a list of Python numbers inside the sample (one 1-D
array field: i64, f64 when one is a float, bool when all are). ``flatten`` turns a sample into its structure (what
reading gives back: dict or tuple, tensors for arrays, Python values for scalars)
and its leaves, by field name.

The schema is inferred from the items: each field's dtype and shape as its first
item gives them; an axis whose length differs between items is ragged. A field's
dtype, rank or kind never changes between items; a second varying axis in one field
is refused unless the user's schema declares it. A user's schema fixes a field's
dtype (with the casts stated in ``cast``) and its shape (``None`` for a ragged axis).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dlop.formats import Field
from dlop.formats.constants import DTYPES

from ..errors import CompileError

_KEY = re.compile(r"[A-Za-z0-9_\-]+")
_FLOATS = ("f16", "bf16", "f32", "f64")
_INTS = ("u8", "u16", "u32", "u64", "i8", "i16", "i32", "i64")
# dtype names a user may give (numpy's and torch's spelling, or the format's)
DTYPE_NAMES = {
    **{name: name for name in DTYPES},
    "float16": "f16",
    "half": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float": "f32",
    "float64": "f64",
    "double": "f64",
    **{f"int{b}": f"i{b}" for b in (8, 16, 32, 64)},
    **{f"uint{b}": f"u{b}" for b in (8, 16, 32, 64)},
    "bool": "bool",
}
_BY_NUMPY = {dt: name for name, dt in DTYPES.items() if name != "bf16"}


class SampleError(CompileError):
    """A sample that no archive can hold as given (names the item and the field)."""


@dataclass(frozen=True)
class Leaf:
    """One field's value: ``array`` a little-endian numpy array (bf16 as its uint16 bits),
    or a str or bytes; ``back`` is what reading gives: array, int, float, bool, str, bytes."""

    value: Any
    dtype: str  # a DTYPES name; "u8" for str and bytes
    back: str

    @property
    def shape(self) -> tuple[int, ...]:
        if self.back in ("str", "bytes"):
            return (len(self.value),)
        return tuple(self.value.shape)


def flatten(sample: Any, item: str) -> tuple[dict[str, Any], dict[str, Leaf]]:
    """(structure, leaves by field name) of one sample; SampleError names the item and field."""
    leaves: dict[str, Leaf] = {}
    structure = _node(sample, "", item, leaves, depth=0)
    if structure.get("type") not in ("dict", "tuple"):
        raise SampleError(
            f"{item}: a sample is a dict of fields or a tuple of them, not a single "
            f"{type(sample).__name__}; return (value,) or {{'name': value}}"
        )
    if not leaves:
        raise SampleError(f"{item}: the sample holds no fields")
    return structure, leaves


def _node(value: Any, name: str, item: str, leaves: dict[str, Leaf], depth: int) -> dict[str, Any]:
    if depth and _numbers(value):  # a list of numbers is one array field (token ids)
        leaves[name] = numbers_leaf(value, f"{item}: field {name!r}")
        return {"field": name, "value": "array"}
    if isinstance(value, Mapping | list | tuple):
        where = f"{item}: field {name!r}" if name else item
        if depth == 2:
            raise SampleError(
                f"{where} is a {type(value).__name__} inside a {'dict' if '.' in name else 'tuple'}"
                " of a sample: samples nest one level at most; make it an array, or flatten it"
            )
        if isinstance(value, Mapping):
            pairs = []
            for key in value:
                if not isinstance(key, str) or not _KEY.fullmatch(key):
                    raise SampleError(
                        f"{where}: key {key!r} is not a field name (1 or more of A-Z a-z 0-9 _ -)"
                    )
                pairs.append((key, value[key]))
            kind = "dict"
        else:
            pairs = [(str(k), v) for k, v in enumerate(value)]
            kind = "tuple"
        if not pairs:
            raise SampleError(f"{where} is an empty {type(value).__name__}")
        fields = []
        for key, v in pairs:
            child = f"{name}.{key}" if name else key
            node = _node(v, child, item, leaves, depth + 1)
            fields.append({"key": key, **node})
        return {"type": kind, "fields": fields}
    if depth == 0:
        return {"type": "leaf"}
    leaves[name] = leaf(value, item, name)
    return {"field": name, "value": leaves[name].back}


def _numbers(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of Python numbers (int, float, bool)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(type(v) in (int, float, bool) for v in value)
    )


def numbers_leaf(value: list[Any], where: str) -> Leaf:
    """A list of numbers as one 1-D array: bool when all are bools, i64 when all are ints
    (bools counted as 0 and 1), else f64."""
    kinds = {type(v) for v in value}
    if kinds == {bool}:
        return Leaf(np.array(value, np.bool_), "bool", "array")
    if float not in kinds:
        try:
            return Leaf(np.array(value, np.int64), "i64", "array")
        except OverflowError:
            raise SampleError(f"{where}: an int in the list does not fit in 64 bits") from None
    return Leaf(np.array(value, np.float64), "f64", "array")


def leaf(value: Any, item: str, name: str) -> Leaf:
    """One value as the archive stores it; SampleError for anything else."""
    where = f"{item}: field {name!r}"
    if isinstance(value, str):  # np.str_ too
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise SampleError(f"{where}: the str holds characters UTF-8 cannot store") from None
        return Leaf(str(value), "u8", "str")
    if isinstance(value, bytes | bytearray | memoryview):  # np.bytes_ too
        return Leaf(bytes(value), "u8", "bytes")
    if isinstance(value, bool | np.bool_):
        return Leaf(np.array(bool(value)), "bool", "bool")
    if isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 63):
            raise SampleError(f"{where}: the int {value} does not fit in 64 bits")
        return Leaf(np.array(value, np.int64), "i64", "int")
    if isinstance(value, float):
        return Leaf(np.array(value, np.float64), "f64", "float")
    if isinstance(value, np.generic):
        array = np.asarray(value)
        back = "int" if value.dtype.kind in "iu" else "float" if value.dtype.kind == "f" else ""
        return Leaf(*_array(array, where), back or "array")
    if isinstance(value, np.ma.MaskedArray):
        raise SampleError(
            f"{where} is a masked array: its mask would be lost; store .filled(value) and "
            "the mask (np.ma.getmaskarray) as two fields"
        )
    if isinstance(value, np.ndarray):
        return Leaf(*_array(value, where), "array")
    if is_tensor(value):
        return Leaf(*_tensor(value, where), "array")
    if value is None:
        raise SampleError(f"{where} is None: return None for the whole sample to skip the item")
    raise SampleError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}: a sample's values are "
        "numpy arrays, torch tensors, numbers, str or bytes (objects are never pickled)"
    )


def _array(array: np.ndarray, where: str) -> tuple[np.ndarray, str]:
    dtype = array.dtype
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
        array = array.astype(dtype)
    name = _BY_NUMPY.get(dtype)
    if name is None:
        raise SampleError(
            f"{where}: dtype {array.dtype} is not one an archive stores ({', '.join(DTYPES)})"
        )
    # (np.ascontiguousarray would make a 0-d array 1-d)
    return (array if array.flags.c_contiguous else array.copy(order="C")), name


def is_tensor(value: Any) -> bool:
    """A torch.Tensor (torch is not imported to find out: a value can be one only once
    torch is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _tensor(value: Any, where: str) -> tuple[np.ndarray, str]:
    import torch

    if value.layout != torch.strided or value.is_nested:
        kind = "nested" if value.is_nested else str(value.layout).removeprefix("torch.")
        raise SampleError(
            f"{where} is a {kind} tensor: store it dense (.to_dense(), or a nested tensor's "
            "parts as fields)"
        )
    t = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), "bf16"
    if t.is_complex() or t.dtype not in _TORCH_OK:
        raise SampleError(f"{where}: tensor dtype {t.dtype} is not one an archive stores")
    return _array(t.numpy(), where)


_TORCH_OK = {
    getattr(__import__("torch"), n)
    for n in ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool")
} | {getattr(__import__("torch"), n) for n in ("uint16", "uint32", "uint64")}


# -- the schema ---------------------------------------------------------------------

_UNSAID = ("codec", "meaning", "units")  # a Spec's JSON leaves these to the Field


@dataclass(frozen=True)
class Spec:
    """One field as the archive stores it, and the items that set it (for messages)."""

    name: str
    kind: str  # array, str, bytes
    dtype: str
    shape: tuple[int | None, ...]
    back: str
    source: str = ""  # the dtype the items give (``dtype`` is what is stored)
    item: str = ""  # the item whose value set the dtype and the fixed lengths
    given: bool = False  # the user's schema set dtype or shape
    shape_given: bool = False

    def to_json(self) -> dict[str, Any]:
        """The stored field as the format writes it (name, kind, dtype, shape), and what
        the compile knows besides."""
        out = {k: v for k, v in self.field("raw").to_json().items() if k not in _UNSAID}
        out.update(
            back=self.back,
            source=self.source,
            item=self.item,
            given=self.given,
            shape_given=self.shape_given,
        )
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Spec:
        """A Spec from to_json's output (the journal's: a damaged one raises)."""
        stored = Field.from_json({**obj, "codec": {"name": "raw"}}, "journal field")
        return cls(
            stored.name,
            stored.kind,
            stored.dtype,
            stored.shape,
            str(obj["back"]),
            str(obj.get("source", stored.dtype)),
            str(obj.get("item", "")),
            bool(obj.get("given")),
            bool(obj.get("shape_given")),
        )

    def field(self, codec: str) -> Field:
        if self.kind == "str":
            return Field.str_(self.name)
        if self.kind == "bytes":
            return Field.bytes_(self.name)
        from dlop.formats.codecs import parse_codec

        chosen = parse_codec(codec if self.shape else "raw").shuffled()
        return Field(self.name, self.dtype, self.shape, codec=chosen)


def given_schema(schema: Mapping[str, Any] | None) -> dict[str, tuple[str | None, Any]]:
    """A user's schema: field -> (dtype name or None, shape list or None). Each entry is a
    dtype name, or {"dtype": ..., "shape": [..., null for a ragged axis, ...]}."""
    out: dict[str, tuple[str | None, Any]] = {}
    if schema is None:
        return out
    if not isinstance(schema, Mapping):
        raise CompileError(f"schema: expected a dict of field -> dtype or spec, got {schema!r:.80}")
    for name, spec in schema.items():
        where = f"schema field {name!r}"
        if isinstance(spec, str):
            spec = {"dtype": spec}
        if not isinstance(spec, Mapping) or set(spec) - {"dtype", "shape"}:
            raise CompileError(
                f'{where}: expected a dtype name or {{"dtype": ..., "shape": [...]}}'
            )
        dtype = spec.get("dtype")
        if dtype is not None:
            dtype = DTYPE_NAMES.get(str(dtype))
            if dtype is None:
                raise CompileError(
                    f"{where}: dtype {spec.get('dtype')!r} is not one of {sorted(DTYPE_NAMES)}"
                )
        shape = spec.get("shape")
        if shape is not None:
            if not isinstance(shape, list | tuple) or not all(
                d is None or (type(d) is int and d >= 0) for d in shape
            ):
                raise CompileError(f"{where}: shape {shape!r} must list lengths, null for ragged")
            shape = tuple(shape)
        out[str(name)] = (dtype, shape)
    return out


def infer(
    leaves: dict[str, Leaf],
    item: str,
    given: dict[str, tuple[str | None, Any]],
    float_dtype: str | None,
) -> dict[str, Spec]:
    """The schema one sample makes, the user's schema and ``float_dtype`` applied."""
    missing = sorted(set(given) - set(leaves))
    if missing:
        raise CompileError(f"schema names field(s) {missing} that {item} does not hold")
    specs = {}
    for name, lf in leaves.items():
        kind = lf.back if lf.back in ("str", "bytes") else "array"
        dtype, shape = given.get(name, (None, None))
        spec = Spec(
            name,
            kind,
            lf.dtype,
            lf.shape,
            lf.back,
            lf.dtype,
            item,
            name in given,
            shape is not None,
        )
        if kind != "array":
            if dtype not in (None, "u8") or shape not in (None, (None,)):
                raise CompileError(f"schema field {name!r}: a {kind} field takes no dtype or shape")
            spec = replace(spec, shape=(None,))
        else:
            if dtype is None and float_dtype is not None and lf.dtype in _FLOATS:
                dtype = float_dtype
            if dtype is not None:
                cast_allowed(lf.dtype, dtype, name, item)
                spec = replace(spec, dtype=dtype)
            if shape is not None:
                if len(shape) != len(lf.shape):
                    raise CompileError(
                        f"schema field {name!r}: shape {list(shape)} has rank {len(shape)}, "
                        f"{item} gives rank {len(lf.shape)} {list(lf.shape)}"
                    )
                spec = replace(spec, shape=shape)
        specs[name] = spec
    for spec in specs.values():  # builds each Field: the format's own bounds and checks
        spec.field("raw")
    return specs


def cast_allowed(have: str, want: str, name: str, item: str) -> None:
    """Refuses a cast the archive does not make: floats go to floats, integers to integers
    (values checked to fit), bool to bool."""
    if have == want:
        return
    if (have in _FLOATS and want in _FLOATS) or (have in _INTS and want in _INTS):
        return
    raise CompileError(
        f"field {name!r}: {item} gives {have} values, which are not stored as {want}: dlop casts "
        "floats to floats and integers to integers (checked to fit); cast them in your code"
    )


@dataclass
class Mismatch(Exception):
    """A sample that breaks the schema; ``widen`` the (field, axis) when only a fixed axis's
    length differs (the compile starts again with it ragged)."""

    message: str
    widen: tuple[str, int] | None = None


def conform(leaves: dict[str, Leaf], specs: dict[str, Spec], item: str) -> dict[str, Any]:
    """The writer's sample for these leaves under the schema; Mismatch says what breaks it."""
    if leaves.keys() != specs.keys():
        extra = sorted(set(leaves) - set(specs))
        missing = sorted(set(specs) - set(leaves))
        first = next(iter(specs.values())).item
        raise Mismatch(
            f"{item} gives fields {_list(extra, 'besides')}{_list(missing, 'without')}those "
            f"{first} gave: every item must give the same fields"
        )
    out: dict[str, Any] = {}
    for name, spec in specs.items():
        lf = leaves[name]
        if lf.back != spec.back:
            raise Mismatch(
                f"field {name!r}: {spec.item} gave a {_what(spec.back)}, {item} gives a "
                f"{_what(lf.back)}: a field keeps one type in every item"
            )
        if spec.kind != "array":
            out[name] = lf.value
            continue
        shape = lf.shape
        if len(shape) != len(spec.shape):
            raise Mismatch(
                f"field {name!r}: {spec.item} gave rank {len(spec.shape)} {list(spec.shape)}, "
                f"{item} gives rank {len(shape)} {list(shape)}: a field keeps its rank in every item"
            )
        value = lf.value
        if lf.dtype != spec.source:
            if not spec.given:
                raise Mismatch(
                    f"field {name!r}: {spec.item} gave {spec.source} {list(spec.shape)}, {item} "
                    f"gives {lf.dtype} {list(shape)}: a field keeps its dtype in every item "
                    "(or pass schema= to store it as one dtype)"
                )
            try:
                cast_allowed(lf.dtype, spec.dtype, name, item)
            except CompileError as e:
                raise Mismatch(str(e)) from None
        if lf.dtype != spec.dtype:
            value = cast(value, lf.dtype, spec.dtype, name, item)
        for axis, (have, want) in enumerate(zip(shape, spec.shape, strict=True)):
            if want is None or have == want:
                continue
            if spec.shape_given:
                raise Mismatch(
                    f"field {name!r}: {item} gives shape {list(shape)}, the schema fixes "
                    f"{list(spec.shape)}"
                )
            ragged = [a for a, d in enumerate(spec.shape) if d is None]
            if ragged:
                raise Mismatch(
                    f"field {name!r}: {item} gives shape {list(shape)}, varying in axis {axis} "
                    f"besides axis {ragged[0]} ({spec.item} gave {list(spec.shape)}): dlop "
                    "infers one varying axis per field; pass schema="
                    f"{{{name!r}: {{'shape': [...]}}}} with null for each varying axis"
                )
            raise Mismatch(
                f"field {name!r}: axis {axis} is {want} long in {spec.item}, {have} in {item}",
                (name, axis),
            )
        out[name] = value
    return out


def _list(names: list[str], how: str) -> str:
    return f"{how} {names} " if names else ""


def _what(back: str) -> str:
    return {"array": "array", "int": "Python int", "float": "Python float", "bool": "bool"}.get(
        back, back
    )


_RANGES = {name: (np.iinfo(DTYPES[name]).min, np.iinfo(DTYPES[name]).max) for name in _INTS}


def cast(value: np.ndarray, have: str, want: str, name: str, item: str) -> np.ndarray:
    """``value`` (dtype ``have``) stored as ``want``: a float rounded to nearest (refused
    where a finite value would become infinite), an integer checked to fit."""
    if have in _INTS:
        if value.size:
            low, high = _RANGES[want]
            if value.min() < low or value.max() > high:
                raise Mismatch(
                    f"field {name!r}: {item} holds values {value.min()}..{value.max()}, outside "
                    f"{want}'s {low}..{high}: refused rather than wrapped"
                )
        return value.astype(DTYPES[want])
    import torch

    source = (
        torch.from_numpy(value.view(np.int16)).view(torch.bfloat16)
        if have == "bf16"
        else (torch.from_numpy(value))
    )
    target = getattr(
        torch, {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}.get(want, "float64")
    )
    out = source.to(target)
    if value.size and bool((torch.isfinite(source) & ~torch.isfinite(out)).any()):
        raise Mismatch(
            f"field {name!r}: {item} holds values beyond {want}'s range (they would become "
            "infinite)"
        )
    if want == "bf16":
        return out.view(torch.int16).numpy().view(np.uint16)
    return out.numpy()


def widened(specs: dict[str, Spec], name: str, axis: int) -> dict[str, Spec]:
    """The schema with ``axis`` of field ``name`` ragged."""
    spec = specs[name]
    shape = tuple(None if a == axis else d for a, d in enumerate(spec.shape))
    return {**specs, name: replace(spec, shape=shape)}


def merge(specs: dict[str, Spec], leaves: dict[str, Leaf], item: str) -> dict[str, Spec]:
    """The schema widened by one more probed sample (conform's checks, then any fixed axis
    whose length differs made ragged)."""
    while True:
        try:
            conform(leaves, specs, item)
            return specs
        except Mismatch as e:
            if e.widen is None:
                raise CompileError(e.message) from None
            specs = widened(specs, *e.widen)

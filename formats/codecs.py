"""Per-field codecs (SPEC.md §3.2) behind one interface, found by name in a registry.

A codec is a small frozen dataclass. It knows its JSON and command-line forms,
how to describe itself to people, and how its values are stored (SPEC.md §4):
either as they are (``mappable``: readers hand out zero-copy views of the data
region) or as independent frames listed in a block table, which the codec's
``block_coder()`` encodes and decodes. Readers and writers choose their storage
from that once per field; no other code asks which codec a field has. Adding a
codec is adding a class here with ``@register``.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np
import zstandard

from .constants import DEFAULT_BLOCK_BYTES, DEFAULT_ZSTD_LEVEL, MAX_BLOCK_RAW_BYTES
from .errors import SchemaError

# One block's value bytes as an encoder takes them: any buffer, never copied to bytes.
Buffer = bytes | bytearray | memoryview


class FrameError(ValueError):
    """A stored frame does not decode to what its block-table row says; the reader
    adds the file, field and block."""


class BlockCoder(Protocol):
    """Encodes and decodes the frames of a block-coded field (SPEC.md §4)."""

    @property
    def block_bytes(self) -> int:
        """A writer closes a block once it holds at least this many uncompressed bytes."""
        ...

    def encoder(self, itemsize: int) -> Callable[[Buffer], bytes]:
        """A function from one block's value bytes to its stored frame (one per writer field)."""
        ...

    def decode(self, frame: memoryview, raw_length: int, itemsize: int) -> np.ndarray:
        """One frame back to exactly ``raw_length`` value bytes, ``(raw_length,) u8``.

        Never allocates more than ``raw_length`` bytes for the output; raises
        FrameError when the frame is damaged or decodes to another length.
        """
        ...


@dataclass(frozen=True)
class Codec(ABC):
    """The interface every codec implements; ``name`` is its key in the registry."""

    name: ClassVar[str]
    # The command-line forms, for messages.
    text_forms: ClassVar[tuple[str, ...]]

    def block_coder(self) -> BlockCoder | None:
        """The frame coder of a block-coded codec; None when values are stored as they are."""
        return None

    @property
    def mappable(self) -> bool:
        """Whether the data region holds the values as they are, so that readers may
        hand out (and gather from) zero-copy views of the mapping."""
        return self.block_coder() is None

    @property
    def regions(self) -> tuple[str, ...]:
        """The regions this codec gives a field, in file order, after any ragged
        ``shapes`` and ``offsets`` (SPEC.md §4)."""
        return ("data",) if self.mappable else ("blocks", "data")

    def shuffled(self) -> Codec:
        """This codec with byte-shuffling on, where it has that option; else itself."""
        return self

    @abstractmethod
    def describe(self) -> str:
        """A short form for people: ``raw``, ``zstd:3+shuffle``."""

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """The header's ``codec`` object (SPEC.md §3.2)."""

    @classmethod
    @abstractmethod
    def from_json(cls, obj: Mapping[str, Any], where: str) -> Codec:
        """Inverse of to_json; raises SchemaError naming ``where``."""

    @classmethod
    @abstractmethod
    def from_text(cls, text: str, options: list[str]) -> Codec:
        """The command-line form ``name[:option...]``, split after the name."""


_REGISTRY: dict[str, type[Codec]] = {}

C = TypeVar("C", bound=type[Codec])


def register(cls: C) -> C:
    """Class decorator: makes a codec known to codec_from_json and parse_codec by its name."""
    if cls.name in _REGISTRY:
        raise SchemaError(f"codec name {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def codec_names() -> tuple[str, ...]:
    """Names of every registered codec."""
    return tuple(_REGISTRY)


def _forms() -> str:
    return ", ".join(form for cls in _REGISTRY.values() for form in cls.text_forms)


def _not_a_codec(text: str) -> SchemaError:
    return SchemaError(f"codec {text!r} is not one of {_forms()}")


def parse_codec(text: str) -> Codec:
    """Parses the command-line form, e.g. ``raw``, ``zstd``, ``zstd:LEVEL``, ``zstd:LEVEL:shuffle``."""
    name, *options = text.strip().lower().split(":")
    cls = _REGISTRY.get(name)
    if cls is None:
        raise _not_a_codec(text)
    return cls.from_text(text, options)


def codec_from_json(obj: Mapping[str, Any], where: str = "codec") -> Codec:
    """The codec a header's ``codec`` object names; SchemaError for an unknown name."""
    name = obj.get("name")
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise SchemaError(
            f"{where}: unknown codec {name!r} (this reader knows {', '.join(_REGISTRY)}); "
            "the archive was written by a newer dlop, or is damaged"
        )
    return cls.from_json(obj, where)


@register
@dataclass(frozen=True)
class Raw(Codec):
    """Values stored as they are; fixed fields map with no copy."""

    name: ClassVar[str] = "raw"
    text_forms: ClassVar[tuple[str, ...]] = ("raw",)

    def describe(self) -> str:
        return "raw"

    def to_json(self) -> dict[str, Any]:
        return {"name": "raw"}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str) -> Raw:
        return cls()

    @classmethod
    def from_text(cls, text: str, options: list[str]) -> Raw:
        if options:
            raise _not_a_codec(text)
        return cls()


# Decompression contexts are not safe to share between threads: one per thread.
_ZSTD = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_ZSTD, "dctx", None)
    if dctx is None:
        dctx = _ZSTD.dctx = zstandard.ZstdDecompressor()
    return dctx


@register
@dataclass(frozen=True)
class Zstd(Codec):
    """Zstandard frames over blocks of whole samples, optionally byte-shuffled."""

    level: int = DEFAULT_ZSTD_LEVEL
    block_bytes: int = DEFAULT_BLOCK_BYTES
    shuffle: bool = False

    name: ClassVar[str] = "zstd"
    text_forms: ClassVar[tuple[str, ...]] = ("zstd", "zstd:LEVEL", "zstd:LEVEL:shuffle")

    def __post_init__(self) -> None:
        if (
            isinstance(self.level, bool)
            or not isinstance(self.level, int)
            or not -7 <= self.level <= 22
        ):
            raise SchemaError(f"zstd level {self.level!r} must be an integer in -7..22")
        if (
            isinstance(self.block_bytes, bool)
            or not isinstance(self.block_bytes, int)
            or not 1 <= self.block_bytes <= MAX_BLOCK_RAW_BYTES
        ):
            raise SchemaError(
                f"zstd block_bytes {self.block_bytes!r} must be an integer in 1..{MAX_BLOCK_RAW_BYTES}"
            )
        if not isinstance(self.shuffle, bool):
            raise SchemaError(f"zstd shuffle {self.shuffle!r} must be true or false")

    def block_coder(self) -> Zstd:
        return self

    def shuffled(self) -> Zstd:
        return replace(self, shuffle=True)

    def describe(self) -> str:
        return f"zstd:{self.level}" + ("+shuffle" if self.shuffle else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "name": "zstd",
            "level": self.level,
            "block_bytes": self.block_bytes,
            "shuffle": self.shuffle,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str) -> Zstd:
        try:
            return cls(
                level=obj.get("level", DEFAULT_ZSTD_LEVEL),
                block_bytes=obj.get("block_bytes", DEFAULT_BLOCK_BYTES),
                shuffle=obj.get("shuffle", False),
            )
        except SchemaError as e:
            raise SchemaError(f"{where}: {e}") from None

    @classmethod
    def from_text(cls, text: str, options: list[str]) -> Zstd:
        if len(options) > 2:
            raise _not_a_codec(text)
        try:
            level = int(options[0]) if options and options[0] else DEFAULT_ZSTD_LEVEL
        except ValueError:
            raise SchemaError(f"codec {text!r}: level {options[0]!r} is not an integer") from None
        shuffle = len(options) == 2
        if shuffle and options[1] != "shuffle":
            raise SchemaError(f"codec {text!r}: the third part may only be 'shuffle'")
        return cls(level=level, shuffle=shuffle)

    def encoder(self, itemsize: int) -> Callable[[Buffer], bytes]:
        # Content checksum and size make each frame self-checking and bound its output.
        cctx = zstandard.ZstdCompressor(
            level=self.level, write_checksum=True, write_content_size=True
        )
        if not self.shuffle:
            return cctx.compress
        return lambda raw: cctx.compress(shuffle_bytes(raw, itemsize).data)  # no copy of it

    def decode(self, frame: memoryview, raw_length: int, itemsize: int) -> np.ndarray:
        try:
            declared = zstandard.frame_content_size(frame)
            if declared != raw_length:
                raise FrameError(f"frame declares {declared} bytes, table says {raw_length}")
            data = _decompressor().decompress(frame, max_output_size=raw_length)
        except zstandard.ZstdError as e:
            raise FrameError(str(e)) from None
        if len(data) != raw_length:
            raise FrameError(f"decoded {len(data)} bytes, expected {raw_length}")
        u8 = np.frombuffer(data, np.uint8)
        return unshuffle_bytes(u8, itemsize) if self.shuffle else u8


def shuffle_bytes(block: bytes | bytearray | memoryview | np.ndarray, itemsize: int) -> np.ndarray:
    """Byte-shuffle: ``(count*itemsize,) u8 -> (itemsize*count,) u8`` planes."""
    arr = block if isinstance(block, np.ndarray) else np.frombuffer(block, np.uint8)
    if itemsize == 1:
        return arr
    return np.ascontiguousarray(arr.reshape(-1, itemsize).T).reshape(-1)


def unshuffle_bytes(block: bytes | np.ndarray, itemsize: int) -> np.ndarray:
    """Inverse of shuffle_bytes."""
    arr = np.frombuffer(block, np.uint8) if isinstance(block, bytes | bytearray) else block
    if itemsize == 1:
        return arr
    planes = arr.reshape(itemsize, -1)
    if itemsize in (2, 4, 8):
        # Assemble whole elements with shifts and ORs in place: sequential
        # passes, unlike a transposed copy, which walks memory with a stride.
        wide = np.dtype(f"<u{itemsize}")
        out = np.empty(planes.shape[1], wide)
        np.copyto(out, planes[0], casting="unsafe")
        tmp = np.empty_like(out)
        for j in range(1, itemsize):
            np.left_shift(planes[j], 8 * j, out=tmp, dtype=wide)
            np.bitwise_or(out, tmp, out=out)
        return out.view(np.uint8)
    return np.ascontiguousarray(planes.T).reshape(-1)

"""The codec interface: registry round trips, unknown names, block-table columns by
name, and no code outside formats/codecs.py asking which codec a field has."""

from __future__ import annotations

import ast
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from dlop.formats import (
    ArchiveReader,
    ArchiveWriter,
    Field,
    FormatError,
    Raw,
    SchemaError,
    ShardReader,
    ShardWriter,
    Zstd,
    parse_codec,
)
from dlop.formats import codecs as codecs_mod
from dlop.formats.codecs import Codec, FrameError, codec_from_json, codec_names
from dlop.formats.constants import BLOCK_COLUMNS, BLOCK_ROW, BLOCK_ROW_BYTES, INDEX_NAME

from .helpers import MIXED_FIELDS, read_header, rewrite_header, write_mixed

ROOT = Path(__file__).resolve().parents[2]

# A few instances of every registered codec; a codec added without examples here fails.
EXAMPLES: dict[str, list[Codec]] = {
    "raw": [Raw()],
    "zstd": [
        Zstd(),
        Zstd(level=-7, block_bytes=1, shuffle=True),
        Zstd(level=22, block_bytes=1 << 31),
    ],
}


def test_every_registered_codec_round_trips_through_json() -> None:
    assert set(codec_names()) == set(EXAMPLES), "give every registered codec examples here"
    for name, examples in EXAMPLES.items():
        for codec in examples:
            obj = json.loads(json.dumps(codec.to_json()))
            assert obj["name"] == name == codec.name
            back = codec_from_json(obj, "test")
            assert back == codec and type(back) is type(codec)
            assert back.describe() == codec.describe()
            assert back.regions[-1] == "data"
            assert back.mappable == (back.block_coder() is None)
            assert back.regions == (("data",) if back.mappable else ("blocks", "data"))
            # and through the command-line form of its description's name
            assert type(parse_codec(name)) is type(codec)


def test_descriptions_and_command_line_forms() -> None:
    assert Raw().describe() == "raw"
    assert Zstd(level=5).describe() == "zstd:5"
    assert Zstd(shuffle=True).describe() == "zstd:3+shuffle"
    assert parse_codec("zstd:7:shuffle") == Zstd(level=7, shuffle=True)
    assert parse_codec(" RAW ") == Raw()
    assert Raw().shuffled() == Raw()
    assert Zstd(level=2, block_bytes=99).shuffled() == Zstd(level=2, block_bytes=99, shuffle=True)
    for text in ("raw:3", "lz4", "zstd:1:shuffle:x", ""):
        with pytest.raises(SchemaError, match="is not one of raw, zstd, zstd:LEVEL"):
            parse_codec(text)
    with pytest.raises(SchemaError, match="may only be 'shuffle'"):
        parse_codec("zstd:3:noshuffle")


@pytest.mark.parametrize("name", ["lz4", "", None, 3, "RAW"])
def test_unknown_codec_name_is_a_clear_schema_error(name: object) -> None:
    with pytest.raises(SchemaError, match=r"field 'x': unknown codec .* knows raw, zstd"):
        codec_from_json({"name": name}, "field 'x'")


def test_bad_codec_options_name_where_they_are() -> None:
    with pytest.raises(SchemaError, match=r"field 'x': zstd level 99"):
        codec_from_json({"name": "zstd", "level": 99}, "field 'x'")


def test_unknown_codec_in_a_shard_header_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "s.dlop"
    write_mixed(path, 5)
    header, _ = read_header(path)
    header["fields"][3]["codec"] = {"name": "lz4"}
    rewrite_header(path, header)
    with pytest.raises(
        FormatError,
        match=r"s\.dlop: field #3 'zfix': unknown codec 'lz4' \(this reader knows raw, zstd\)",
    ):
        ShardReader(path)


def test_unknown_codec_in_index_json_is_a_format_error(tmp_path: Path) -> None:
    with ArchiveWriter(tmp_path / "a", [Field("x", "u8", (2,), codec=Zstd())]) as w:
        w.write({"x": np.zeros(2, np.uint8)})
    index = tmp_path / "a" / INDEX_NAME
    obj = json.loads(index.read_text())
    obj["schema"][0]["codec"]["name"] = "brotli"
    index.write_text(json.dumps(obj))
    with pytest.raises(
        FormatError, match=r"index\.json: schema entry #0 'x': unknown codec 'brotli'"
    ):
        ArchiveReader(tmp_path / "a")


def test_block_table_columns_are_named_once(tmp_path: Path) -> None:
    assert BLOCK_ROW.names == BLOCK_COLUMNS and BLOCK_ROW.itemsize == BLOCK_ROW_BYTES == 40
    path = tmp_path / "s.dlop"
    samples = write_mixed(path, 12)
    with ShardReader(path) as r:
        for name in ("zfix", "zrag", "blob"):
            table, rows = r.block_table(name), r.blocks(name)
            assert table.dtype == BLOCK_ROW and rows.shape == (len(table), len(BLOCK_COLUMNS))
            for j, column in enumerate(BLOCK_COLUMNS):
                assert np.array_equal(table[column], rows[:, j])
            assert table["first_sample"][0] == 0
            assert int(table["raw_length"].sum()) == r.value_bytes(name)
            for k, row in enumerate(table):
                assert zlib.crc32(r.compressed_block(name, k)) == row["crc32"]
        assert r.value_bytes("feat") == 12 * 15 * 2
        assert r.value_bytes("rag") == sum(s["rag"].nbytes for s in samples)
        with pytest.raises(SchemaError, match=r"'feat' has no block table \(codec raw\)"):
            r.block_table("feat")
        with pytest.raises(SchemaError, match=r"'zfix' is not a fixed field stored as it is"):
            r.array("zfix")
        with pytest.raises(SchemaError, match=r"'zrag' is not a ragged field stored as it is"):
            r.values("zrag")


@dataclass(frozen=True)
class _Xor(Codec):
    """A block codec known only to this test: frames are the values XOR 0x5A, plus a tag."""

    block_bytes: int = 7

    name: ClassVar[str] = "xor-test"
    text_forms: ClassVar[tuple[str, ...]] = ("xor-test",)

    def block_coder(self) -> _Xor:
        return self

    def describe(self) -> str:
        return "xor-test"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "block_bytes": self.block_bytes}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> _Xor:
        return cls(block_bytes=obj["block_bytes"])

    @classmethod
    def from_text(cls, text: str, options: list[str]) -> _Xor:
        return cls()

    def encoder(self, itemsize: int) -> Callable[[bytes], bytes]:
        return lambda raw: b"X" + (np.frombuffer(raw, np.uint8) ^ 0x5A).tobytes()

    def decode(self, frame: memoryview, raw_length: int, itemsize: int) -> np.ndarray:
        if len(frame) != raw_length + 1 or frame[0] != ord("X"):
            raise FrameError(f"not an xor-test frame of {raw_length} bytes")
        return np.frombuffer(frame[1:], np.uint8) ^ 0x5A


def test_a_new_block_codec_needs_no_reader_or_writer_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(codecs_mod._REGISTRY, _Xor.name, _Xor)
    fields = [Field("v", "i16", (None,), codec=_Xor()), Field("t", "u8", (3,), codec=_Xor(4))]
    path = tmp_path / "x.dlop"
    with ShardWriter(path, fields) as w:
        for i in range(9):
            w.write({"v": np.arange(i, dtype=np.int16) * 300, "t": np.full(3, i, np.uint8)})
    with ShardReader(path, verify=True) as r:
        assert len(r.block_table("v")) > 1
        for i in range(9):
            assert np.array_equal(r.get("v", i), np.arange(i, dtype=np.int16) * 300)
        assert np.array_equal(r.read_range("t", 2, 8), np.repeat(np.arange(2, 8), 3).reshape(6, 3))
        frame_at = r.layout_of("t").regions["data"].offset
    data = bytearray(path.read_bytes())
    data[frame_at] = ord("Y")  # the frame's tag; the reader must name field and block
    path.write_bytes(bytes(data))
    with ShardReader(path) as r:
        problems = [str(p) for p in r.verify()]
        assert any("field 't' block 0" in p and "CRC-32" in p for p in problems)
        with pytest.raises(FormatError, match=r"field 't' block 0: not an xor-test frame"):
            r.get("t", 0)


def _codec_class_names() -> set[str]:
    return {"Codec", *(type(c).__name__ for cs in EXAMPLES.values() for c in cs)}


def test_no_code_asks_which_codec_a_field_has() -> None:
    """Outside formats/codecs.py, nothing under formats/ or tools/ calls isinstance
    on a codec class or compares anything with a codec's name."""
    classes, names = _codec_class_names(), set(codec_names())
    offences = []
    for folder in ("formats", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "formats" / "codecs.py":
                continue
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in ("isinstance", "issubclass")
                    and len(node.args) == 2
                ):
                    used = {
                        n.id if isinstance(n, ast.Name) else n.attr
                        for n in ast.walk(node.args[1])
                        if isinstance(n, ast.Name | ast.Attribute)
                    }
                    if used & classes:
                        offences.append(f"{where}: isinstance on {sorted(used & classes)}")
                if isinstance(node, ast.Compare):
                    consts = {
                        n.value
                        for n in [node.left, *node.comparators]
                        if isinstance(n, ast.Constant) and isinstance(n.value, str)
                    }
                    if consts & names:
                        offences.append(
                            f"{where}: compares with codec name {sorted(consts & names)}"
                        )
    assert not offences, "dispatch through the codec interface instead:\n" + "\n".join(offences)


def test_mixed_fields_cover_both_storages() -> None:
    # The shared fixture keeps exercising mapped and block-coded storage.
    assert {f.codec.mappable for f in MIXED_FIELDS} == {True, False}

"""The cost of parsing archive metadata is bounded, not only its bytes (SPEC.md §8).

index.json, errors.jsonl and shard headers are scanned before they are
parsed: nesting, the number of JSON values and the length of number tokens
are refused past their bounds, whatever the interpreter's own integer-digit
limit is. errors.jsonl is read lazily, record by record, and never past the
index's skipped count. Cost is checked by counting parsed values (never by
timing); the one end-to-end case runs in a child with a capped address space.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlop.formats import ArchiveReader, ArchiveWriter, Field, FormatError, SchemaError, read_index
from dlop.formats import constants as c
from dlop.formats.files import loads_bounded
from dlop.formats.header import parse_header


def make_archive(path: Path, skipped: int = 1) -> Path:
    with ArchiveWriter(path, [Field("label", "i64", ())]) as w:
        for i in range(3):
            w.write({"label": i})
        for i in range(skipped):
            w.skip(f"bad{i}.wav", "zero-byte file", key=f"k{i}")
    return path


def edit_index(archive: Path, **top: Any) -> None:
    obj = json.loads((archive / "index.json").read_text())
    obj.update(top)
    (archive / "index.json").write_text(json.dumps(obj))


@pytest.fixture
def few_digits() -> Iterator[None]:
    """Python's int-string digit limit off, as PYTHONINTMAXSTRDIGITS=0 sets it."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(before)


@pytest.fixture
def parsed_lines(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the errors.jsonl lines handed to the JSON parser."""
    import dlop.formats.skipped as skipped

    calls: list[int] = []
    real = json.loads

    def counting(text: Any, **kw: Any) -> Any:
        if sys._getframe(1).f_globals["__name__"] == skipped.__name__:
            calls.append(len(text))
        return real(text, **kw)

    monkeypatch.setattr(skipped.json, "loads", counting)
    return calls


# -- errors.jsonl ------------------------------------------------------------------------------


def test_errors_lines_must_be_flat_objects(tmp_path: Path, parsed_lines: list[int]) -> None:
    a = make_archive(tmp_path / "a")
    (a / "errors.jsonl").write_bytes(b"[]\n" * 200_000)
    with ArchiveReader(a) as r, pytest.raises(FormatError, match=r"errors\.jsonl line 1.*object"):
        r.errors()
    assert len(parsed_lines) <= 1


def test_errors_never_read_past_the_index_count(tmp_path: Path, parsed_lines: list[int]) -> None:
    a = make_archive(tmp_path / "a", skipped=2)
    line = json.dumps({"path": "x.wav", "reason": "bad"}).encode() + b"\n"
    (a / "errors.jsonl").write_bytes(line * 100_000)
    with (
        ArchiveReader(a) as r,
        pytest.raises(FormatError, match=r"line 3: more records than the 2"),
    ):
        r.errors()
    assert len(parsed_lines) <= 2


def test_errors_fewer_records_than_the_count(tmp_path: Path) -> None:
    a = make_archive(tmp_path / "a", skipped=3)
    lines = (a / "errors.jsonl").read_bytes().splitlines(keepends=True)
    (a / "errors.jsonl").write_bytes(b"".join(lines[:2]))
    with ArchiveReader(a) as r:
        assert len(r.errors(limit=2)) == 2
        with pytest.raises(FormatError, match=r"holds 2 records; index\.json counts 3"):
            r.errors()
        assert [p.message for p in r.verify()] == [
            "holds 2 records; index.json counts 3 skipped inputs"
        ]
    (a / "errors.jsonl").unlink()
    with ArchiveReader(a) as r, pytest.raises(FormatError, match="missing"):
        r.errors()


def test_errors_limit_parses_only_what_it_returns(tmp_path: Path, parsed_lines: list[int]) -> None:
    a = make_archive(tmp_path / "a", skipped=5000)
    with ArchiveReader(a) as r:
        first = r.errors(limit=20)
        assert [e["path"] for e in first] == [f"bad{i}.wav" for i in range(20)]
        assert len(parsed_lines) == 20
        assert len(r.errors()) == 5000


@pytest.mark.parametrize(
    ("line", "match"),
    [
        (b'{"path": "a", "reason": [[1]]}', "nests arrays and objects 3 deep"),
        (b'{"path": "a", "reason": 5}', "'reason' is 5, expected a string"),
        (b'{"path": "a", "reason": "r", "x": {}}', "nests arrays and objects 2 deep"),
        (b'{"path": "a", "reason": "r", "n": ' + b"9" * 40 + b"}", "number 40 characters"),
        (b'{"path": "a", "reason": "' + b"r" * (70 << 10) + b'"}', "longer than 65536"),
        (b"", "not a UTF-8 JSON object"),
        (b'{"path": "a"}', "'reason' is None"),
        (
            json.dumps({"path": "a", "reason": "r", **{str(i): i for i in range(20)}}).encode(),
            "22 keys",
        ),
    ],
)
def test_errors_record_shape(tmp_path: Path, line: bytes, match: str) -> None:
    a = make_archive(tmp_path / "a", skipped=2)
    good = json.dumps({"path": "x.wav", "reason": "bad"}).encode()
    (a / "errors.jsonl").write_bytes(good + b"\n" + line + b"\n")
    with ArchiveReader(a) as r:
        assert r.errors(limit=1) == [{"path": "x.wav", "reason": "bad"}]
        with pytest.raises(FormatError, match=match) as e:
            r.errors()
    assert "errors.jsonl" in str(e.value) and "line 2" in str(e.value)


def test_writer_refuses_records_a_reader_would_refuse(tmp_path: Path) -> None:
    with ArchiveWriter(tmp_path / "a", [Field("label", "i64", ())]) as w:
        with pytest.raises(SchemaError, match="holds a list"):
            w.skip("a.wav", "bad", detail=[1, 2])
        with pytest.raises(SchemaError, match="bytes as JSON"):
            w.skip("a.wav", "r" * (70 << 10))
        with pytest.raises(SchemaError, match="number"):
            w.skip("a.wav", "bad", size=10**40)
        w.write({"label": 1})


def test_info_reads_only_the_skipped_inputs_it_lists(
    tmp_path: Path, parsed_lines: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    from dlop.tools.inspect_cli import main

    a = make_archive(tmp_path / "a", skipped=5000)
    assert main(["info", str(a)]) == 0
    out = capsys.readouterr().out
    assert "bad19.wav: zero-byte file" in out and "... and 4980 more in errors.jsonl" in out
    assert len(parsed_lines) == 20
    assert main(["info", str(a), "--json"]) == 0
    skipped = json.loads(capsys.readouterr().out)["skipped"]
    assert len(skipped["inputs"]) == 1000 and skipped["not_listed"] == 4000


CHILD = textwrap.dedent(
    """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    from dlop.tools.inspect_cli import main
    sys.exit(main(["info", sys.argv[1]]))
    """
)


def test_info_on_a_huge_errors_file_is_cheap(tmp_path: Path) -> None:
    """64 MiB of `[]` lines, ~22 million of them: refused at the first, in 1 GiB of address space."""
    a = make_archive(tmp_path / "a")
    with open(a / "errors.jsonl", "wb") as fh:
        for _ in range(64):
            fh.write(b"[]\n" * ((1 << 20) // 3))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(a)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "errors.jsonl line 1" in proc.stderr and "not an object" in proc.stderr, proc.stderr


# -- index.json --------------------------------------------------------------------------------


def test_index_values_are_counted_before_parsing(tmp_path: Path) -> None:
    """Millions of `[]` under a key the reader does not know are refused unparsed."""
    a = make_archive(tmp_path / "a")
    text = (a / "index.json").read_text()
    wide = "[" + ",".join(["[]"] * (c.MAX_JSON_VALUES + 1)) + "]"
    (a / "index.json").write_text(text.rstrip().rstrip("}") + f', "future": {wide}}}')
    with pytest.raises(FormatError, match=r"index\.json.*JSON values and keys; the limit is"):
        read_index(a)


def test_unknown_top_level_keys_within_bounds_are_ignored(tmp_path: Path) -> None:
    a = make_archive(tmp_path / "a")
    edit_index(a, future={"x": [1, 2, 3]})
    assert read_index(a).num_samples == 3


def test_index_shard_count_and_size_bounds(tmp_path: Path) -> None:
    a = make_archive(tmp_path / "a")
    text = (a / "index.json").read_text()
    entry = '{"file": "shard-00000.dlop", "num_samples": 0, "bytes": 0, "crc32": 0}'
    many = "[" + ",".join([entry] * (c.MAX_SHARDS + 1)) + "]"
    start = text.index('"shards": [') + len('"shards": ')
    end = text.index("]", start) + 1
    (a / "index.json").write_text(text[:start] + many + text[end:])
    with pytest.raises(FormatError, match=f"lists {c.MAX_SHARDS + 1} shards; .* at most"):
        read_index(a)
    # The shard entries of the largest archive, as the writer writes them, take 17 MiB of the cap.
    most = {"num_samples": 1 << 40, "bytes": (1 << 64) - 1, "crc32": (1 << 32) - 1}
    two = [dict(file=f"shard-{c.MAX_SHARDS - 1:05d}.dlop", **most)] * 2
    per_entry = len(json.dumps({"shards": two}, indent=1)) - len(
        json.dumps({"shards": two[:1]}, indent=1)
    )
    assert per_entry * c.MAX_SHARDS <= 17 << 20 < c.MAX_INDEX_BYTES <= 32 << 20


@pytest.mark.parametrize(
    "skipped", [{"count": -1}, {"count": c.MAX_ERRORS_RECORDS + 1}, {"count": "1"}, ["a.wav"]]
)
def test_index_skipped_count_is_checked(tmp_path: Path, skipped: Any) -> None:
    a = make_archive(tmp_path / "a")
    edit_index(a, skipped=skipped)
    with pytest.raises(FormatError, match="'skipped'"):
        read_index(a)


# -- number tokens -----------------------------------------------------------------------------


def test_long_numbers_refused_without_the_interpreter_digit_limit(
    tmp_path: Path, few_digits: None
) -> None:
    body = b'{"format": "dlop-shard", "num_samples": ' + b"9" * 5000 + b"}"
    with pytest.raises(FormatError, match="number 5000 characters long"):
        loads_bounded("h", body, "header")
    with pytest.raises(FormatError, match=r"s\.dlop.*number"):
        parse_header(tmp_path / "s.dlop", body, zlib.crc32(body), 1 << 20)
    a = make_archive(tmp_path / "a")
    text = (a / "index.json").read_text()
    (a / "index.json").write_text(text.replace('"version": 1', '"version": 1' + "0" * 100_000))
    with pytest.raises(FormatError, match=r"index\.json.*number 100001 characters"):
        read_index(a)


def test_numbers_up_to_the_bound_still_parse(few_digits: None) -> None:
    assert loads_bounded("x", b"[18446744073709551615, -1.2345678901234567e-308]", "x") == [
        (1 << 64) - 1,
        -1.2345678901234567e-308,
    ]
    assert loads_bounded("x", b'["' + b"9" * 5000 + b'"]', "x") == ["9" * 5000]


def test_writer_refuses_an_index_a_reader_would_refuse(tmp_path: Path) -> None:
    with (
        pytest.raises(SchemaError, match="number"),
        ArchiveWriter(tmp_path / "a", [Field("label", "i64", ())], metadata={"n": 10**40}) as w,
    ):
        w.write({"label": 1})
    assert not (tmp_path / "a" / "index.json").exists()

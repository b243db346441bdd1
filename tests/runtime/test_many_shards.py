"""An archive of more shards than the soft limit on open files allows (1024 on many
Linux machines) reads whole, locally and through the node cache: opening it raises the
limit toward the hard one (each mapped shard keeps a descriptor, a cached one two).
Where even the hard limit is too low, the error says so and how to raise it, at once,
never a retried "network" failure. Each case runs in a process of its own, whose limits
are set before it starts."""

from __future__ import annotations

import errno
import json
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dlop.formats import ArchiveWriter, Field
from dlop.formats.errors import ResourceLimitError
from dlop.formats.limits import SPARE_FILES, open_files, room_for_files, too_many_files
from dlop.formats.storage import files_full
from tests.faultproxy import FaultProxy

SHARDS = 300

READ = """
import json, resource, sys
from dlop.runtime import Loader
source, options = json.loads(sys.argv[1]), json.loads(sys.argv[2])
try:
    n = sum(len(b["x"]) for b in Loader(source, 32, seed=0, **options))
    print(json.dumps({"read": n, "soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}))
except Exception as e:
    chain, at = [], e
    while at is not None:
        chain.append(type(at).__name__ + ": " + str(at))
        at = at.__cause__ or at.__context__
    print(json.dumps({"error": chain}))
"""


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("many")
    for name in ("a", "b"):
        with ArchiveWriter(root / name, [Field("x", "f32", (4,))], shard_bytes=1) as w:
            for i in range(SHARDS):
                w.write({"x": np.full(4, i, np.float32)})
        assert len(list((root / name).glob("shard-*"))) == SHARDS
    return root


def read_with_limits(url: str | list[str], soft: int, hard: int, **options: object) -> dict:
    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    done = subprocess.run(
        [sys.executable, "-c", READ, json.dumps(url), json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limited,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_local_archive_of_more_shards_than_the_soft_limit_reads_whole(many: Path) -> None:
    got = read_with_limits(str(many / "a"), 128, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    assert got.get("read") == SHARDS, got
    assert got["soft"] > SHARDS  # raised as far as the archive needs


def test_archives_read_as_one_count_every_archives_shards(many: Path) -> None:
    """Each archive opens before the one before it has mapped its shards: the limit is
    raised for all of them, and once more when a shard meets it all the same."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    got = read_with_limits([str(many / "a"), str(many / "b")], 128, hard)
    assert got.get("read") == 2 * SHARDS, got
    assert got["soft"] > 2 * SHARDS


def test_a_hard_limit_too_low_is_named_with_its_remedy(many: Path) -> None:
    got = read_with_limits(str(many / "a"), 128, 200)
    assert "error" in got, got
    assert any(
        "ResourceLimitError" in e and "`ulimit -n`" in e and "at most 200" in e
        for e in got["error"]
    ), got


def test_through_the_node_cache_too_and_never_retried_as_a_network_fault(
    many: Path, tmp_path: Path
) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    with FaultProxy(root=many) as proxy:  # the server's descriptors are not the reader's
        cache = {"cache_dir": str(tmp_path / "c")}
        got = read_with_limits(proxy.url + "/a", 128, hard, **cache)
        assert got.get("read") == SHARDS, got
        assert got["soft"] > 2 * SHARDS  # a cached shard held open keeps two
        asked = len(proxy.asked)
        got = read_with_limits(proxy.url + "/a", 128, 400, cache_dir=str(tmp_path / "d"))
        assert "error" in got and "ResourceLimitError" in " ".join(got["error"]), got
        # the shard that met the limit was asked for once, not once a retry
        again = [p for p, _ in proxy.asked[asked:]]
        assert max(again.count(p) for p in set(again)) <= 2
        # and from the warm cache: the limit, not a cached copy blamed for it
        got = read_with_limits(proxy.url + "/a", 128, 400, **cache)
        assert "error" in got and "ResourceLimitError" in " ".join(got["error"]), got
        assert "does not read" not in " ".join(got["error"])


def test_a_full_table_is_found_inside_a_clients_own_error() -> None:
    try:
        try:
            raise OSError(errno.EMFILE, "Too many open files")
        except OSError as inner:
            raise FileNotFoundError("http://host/a/shard-00001.dlop") from inner
    except FileNotFoundError as e:
        assert files_full(e)
        assert "ulimit" in str(too_many_files("x", e))
    assert not files_full(FileNotFoundError("gone"))
    full = too_many_files("x", OSError(errno.ENFILE, "Too many open files in system"))
    assert isinstance(full, ResourceLimitError) and "fs.file-max" in str(full)


def test_room_for_files_raises_the_soft_limit_no_further_than_needed() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        now = open_files()
        assert now is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (now + 20, hard))
        need = now + 100 + SPARE_FILES
        room_for_files(100)
        assert need - 2 <= resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= need + 2
        resource.setrlimit(resource.RLIMIT_NOFILE, (now, hard))
        assert open_files() == now  # a full table: its listing cannot be opened
        room_for_files(hard * 2)  # more than the hard limit: as far as it goes
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

"""A raw shard fetched into the node-local cache in ranged parts, written in place, and
served piece by piece as its checksums pass: the first epoch streams.

The shard's temporary cache file is made at full size within the budget
(runtime.storage.cache ``arrive``). First its *front* arrives: every byte but the
data of fields that carry CRC pieces (SPEC.md §4 ``crcs``): the header, the
metadata regions, the data of fields without pieces, the padding. It is accepted
as a whole once the header CRC, every metadata region's CRC (checked by opening
it, formats.reader) and every piece-less data region's CRC pass; otherwise it is
fetched again, as any failed try. Then the pieced data arrives in parts of
``Retry.part_bytes`` or more (``part_pieces``), fetched on the supply's part threads in the order this
process's epoch first reads their samples (``Incoming.ranks``), a part some batch
waits for jumping the queue. A part is accepted once every piece in it matches its
CRC, else fetched again; only then is it written, and its pieces marked verified.
A batch reads a sample once every piece its bytes lie in is verified
(``Incoming.missing``), so no unverified byte reaches a batch. When every part
goes in the first wave, the front's last span (the metadata a dlop writer puts
after the values) rides in the same request as the part before it
(``Incoming.ride``): one request fewer a shard.

A shard that one wave of parts covers (``lead_spans``) does not wait for its header
to plan them: its bytes are asked for at once in as many byte ranges as part
threads (``Lead``), each written unverified into the temporary file as it comes;
the header, the front and every part then take their first try's bytes from there
(mapped, not copied) and check them exactly as fetched bytes. Its parts are cut at the
ranges' edges (``cut_at``), so that a part waits for one range only. A range that
fails counts as the first try of whoever needs its bytes, who fetch them on their
own retries.

When the last part lands, the whole file's CRC, composed from the parts', must
equal the index's; the file is then synced and renamed into place like any cached
shard. A shard without pieces (written before them) is all front: verified whole
before it is served, as before.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import mmap
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from dataclasses import field as made

import numpy as np

from dlop.formats import Field, FormatError, ShardReader
from dlop.formats.crc import crc32, crc32_combine
from dlop.formats.header import FieldLayout, ShardLayout
from dlop.formats.storage import Rejected, Retry, Storage, retrying

from .cache import Arriving, Held, write_at
from .remote import HEAD_BYTES, each_span

QUEUED, FLYING, DONE = 0, 1, 2
UNREAD = np.iinfo(np.int64).max  # the rank of what this epoch does not read
LATER = UNREAD - 1  # the rank of a part whose samples' places are not known yet
TAIL_WAIT_S = 60.0  # the longest the front waits for that part before reading the span itself
LEAD = -2  # the rank of a lead range: before any part (a part may wait for its ranges)
WAITING, LANDED, LOST = 0, 1, 2  # a lead range's states
Span = tuple[int, int]


@dataclass
class Pieced:
    """A data region that carries CRC pieces, and which of them are verified here; its
    CRCs (and a ragged field's offsets) are known once the front is in."""

    fdef: Field
    offset: int  # of the data region in the file
    length: int
    size: int  # bytes a piece
    count: int  # pieces
    crcs: np.ndarray | None = None  # one per piece (a copy: the file's bytes are read once)
    offsets: np.ndarray | None = None  # a ragged field's element offsets (verified on open)
    verified: np.ndarray = made(init=False)
    part_of: np.ndarray = made(init=False)

    def __post_init__(self) -> None:
        self.verified = np.zeros(self.count, bool)
        self.part_of = np.zeros(self.count, np.int64)

    def spans_known(self) -> bool:
        """Whether its samples' byte spans are known (a ragged field's: after the front)."""
        return not self.fdef.ragged or self.offsets is not None

    def byte_spans(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each sample's values lie, in bytes from the region's start."""
        f = self.fdef
        if self.offsets is not None:
            lo = self.offsets[samples].astype(np.int64) * f.itemsize
            hi = self.offsets[samples + 1].astype(np.int64) * f.itemsize
            return lo, hi
        lo = samples.astype(np.int64) * f.sample_bytes
        return lo, lo + f.sample_bytes

    def pieces_of(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every piece the samples' bytes lie in, and the position in ``samples`` of the
        sample each is for (an empty sample lies in none)."""
        lo, hi = self.byte_spans(samples)
        full = hi > lo
        first, last = lo // self.size, (hi - 1) // self.size
        count = np.where(full, last - first + 1, 0)
        ends = np.cumsum(count)
        owner = np.repeat(np.arange(len(samples)), count)
        within = np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - count, count)
        return np.repeat(first, count) + within, owner


@dataclass
class Part:
    """Pieces ``p0:p1`` of pieced region ``region``: file bytes ``lo:hi``, asked for as
    ``lo:end``."""

    region: int
    p0: int
    p1: int
    lo: int
    hi: int
    end: int  # where its request ends: ``hi``, or the file's end when the front's last span rides
    state: int = QUEUED
    crc: int = 0
    rank: int = 0  # its place in the fetch queue (-1: a batch waits for it)


def lead_spans(size: int, retry: Retry) -> list[Span]:
    """The byte ranges a shard of ``size`` bytes is asked for in before its header is
    read: as many as ``retry.parallel_parts``, each at least ``part_bytes`` (or the
    whole file) and at most four times it, as its parts would be; none when one such
    wave does not cover the file, or ``retry.lead`` is off."""
    if not retry.lead or size <= 0:
        return []
    # a range holds the first read of a header at least (one request for a small file)
    unit = max(HEAD_BYTES, retry.part_bytes)
    n = max(1, min(retry.parallel_parts, size // unit))
    if size > n * 4 * unit:
        return []
    step = -(-size // n)
    return [(a, min(a + step, size)) for a in range(0, size, step)]


class Lead:
    """A shard's bytes asked for before its header is read (``lead_spans``): each range
    is written unverified into ``arriving`` as it arrives; readers take their first
    try's bytes from there once their ranges are in whole (``take``) and check them as
    fetched ones. A range that
    fails, or is waited for in vain, is LOST: its late bytes are never written, and
    whoever needs them fetches them. ``stop`` ends it all (the shard landed or failed)."""

    def __init__(self, arriving: Arriving, spans: list[Span]) -> None:
        self.arriving = arriving
        self.spans = spans
        self.state = [WAITING] * len(spans)
        self.cond = threading.Condition()
        self.writing = 0
        self.stopped = False
        self.errors: list[Exception | None] = [None] * len(spans)  # why a range was lost
        self.mapped: mmap.mmap | None = None  # the file, once a reader takes bytes

    def fetch(self, i: int, store: Storage, name: str) -> None:
        """Fetches range ``i`` once (a part thread), writing each chunk as it arrives, so
        that the range is in the file soon after its last byte came; LOST on any
        failure, and no chunk is written once it is lost or the lead stopped."""
        lo, hi = self.spans[i]
        with self.cond:
            if self.stopped or self.state[i] != WAITING:
                return
        at = lo
        error: Exception | None = None
        chunks = store.read_chunks(name, lo, hi)
        try:
            for data in chunks:
                if at + len(data) > hi:  # never past its span: a neighbour's bytes lie there
                    error = Rejected(f"got more than the {hi - lo} bytes asked for from {lo}")
                    break
                if not self.write(i, data, at):
                    return  # lost meanwhile (a reader gave up on it), or stopped
                at += len(data)
            if error is None and at != hi:
                error = Rejected(
                    f"got {at - lo} bytes of the {hi - lo} from {lo} (truncated transfer?)"
                )
        except Exception as e:  # the first try of whoever needs these bytes failed
            error = e
        finally:
            with self.cond:
                if self.state[i] == WAITING:
                    if error is None and at == hi:
                        self.state[i] = LANDED
                    else:
                        self.state[i], self.errors[i] = LOST, error
                self.cond.notify_all()
            chunks.close()  # a range given up on ends its request

    def write(self, i: int, data: bytes | memoryview, at: int) -> bool:
        """Writes a chunk of range ``i`` at ``at``, unless the range is no longer awaited
        (False). A full disk loses the range: the reader's own write names it."""
        with self.cond:
            if self.stopped or self.state[i] != WAITING:
                return False
            self.writing += 1
        try:
            write_at(self.arriving.fd, data, at)
            return True
        except OSError:
            with self.cond:
                if self.state[i] == WAITING:
                    self.state[i] = LOST
            return False
        finally:
            with self.cond:
                self.writing -= 1
                self.cond.notify_all()

    def take(self, lo: int, hi: int) -> memoryview | None:
        """Bytes ``lo:hi`` of the file once every range holding them is in. Otherwise
        (one failed or is lost, the lead stopped, or they are not in within
        ``TAIL_WAIT_S``) every range holding them not yet in is lost, its bytes never written,
        and no write of the lead is under way when this returns: the caller fetches
        them and writes them itself, and nothing overwrites that. None then, or the
        failure of a range: the caller's first try, counted as such (a refusal is not
        asked again, a short answer is a truncated transfer)."""
        mine = [i for i, (a, b) in enumerate(self.spans) if a < hi and b > lo]
        deadline = time.monotonic() + TAIL_WAIT_S
        with self.cond:
            while True:
                states = [self.state[i] for i in mine]
                if not self.stopped and all(s == LANDED for s in states):
                    return self.view(lo, hi)
                failed = [e for i in mine if (e := self.errors[i]) is not None]
                left = deadline - time.monotonic()
                if self.stopped or failed or LOST in states or left <= 0:
                    for i in mine:
                        if self.state[i] == WAITING:
                            self.state[i] = LOST
                    while self.writing:  # a write under way ends before the reader's
                        self.cond.wait()
                    self.cond.notify_all()
                    if failed and not self.stopped:
                        raise failed[0]
                    return None
                self.cond.wait(min(left, 0.5))

    def view(self, lo: int, hi: int) -> memoryview:
        """Bytes ``lo:hi`` of the file, mapped (not copied; read-only); call under
        ``cond``, not stopped."""
        if self.mapped is None:
            # through a descriptor of its own: a mapping keeps a copy of the one it is
            # made from, and a copy of the file's own would keep its lock held
            fd = os.open(self.arriving.tmp, os.O_RDONLY | os.O_CLOEXEC)
            try:
                self.mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        return memoryview(self.mapped)[lo:hi]

    def stop(self) -> None:
        """No range is written from now on (returns once a write under way is done), and
        the mapping goes: a file removed from the cache gives back its space."""
        with self.cond:
            self.stopped = True
            while self.writing:
                self.cond.wait()
            self.cond.notify_all()
            mapped, self.mapped = self.mapped, None
        if mapped is not None:
            with contextlib.suppress(BufferError):  # a view still in use: it goes with it
                mapped.close()


class Incoming:
    """Shard ``k`` arriving into ``arriving`` (its temporary cache file), laid out as
    ``layout`` says: ``parts`` of its pieced data come in on part threads, each checked
    once the front is in (``fronted``: ``reader`` maps the file from then on)."""

    def __init__(
        self,
        k: int,
        arriving: Arriving,
        layout: ShardLayout,
        head: int,
        retry: Retry,
        keep: bool,
        lead: Lead | None = None,
        stopping: threading.Event | None = None,
    ) -> None:
        self.k = k
        self.arriving = arriving
        # its fetch's generation, set when the supply closes: a part of it is never
        # queued after that, nor its failure recorded against the shard
        self.stopping = threading.Event() if stopping is None else stopping
        self.num_samples = layout.num_samples
        self.reader: ShardReader | None = None
        self.fronts: list[tuple[int, int, int]] = []  # (lo, hi, crc) of every front span
        self.gaps = gaps_of(layout, arriving.size, head)
        self.keep = keep  # held when it lands (a batch asked for it), or only cached
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.done = False
        self.writing = 0
        self.pieced = [
            Pieced(fl.field, data.offset, data.length, piece, fl.pieces())
            for fl in layout.fields
            if is_pieced(fl) and (piece := fl.crc_piece_bytes) and (data := fl.regions["data"])
        ]
        self.parts: list[Part] = []
        for r, pc in enumerate(self.pieced):
            if lead is None:
                step = part_pieces(pc.length, pc.size, retry)
                bounds = [*range(0, pc.count, step), pc.count]
            else:  # a part within one lead range, and the piece across each cut alone
                bounds = cut_at(pc, [lo for lo, _ in lead.spans[1:]])
            for p0, p1 in itertools.pairwise(bounds):
                pc.part_of[p0:p1] = len(self.parts)
                hi = min(pc.offset + p1 * pc.size, pc.offset + pc.length)
                self.parts.append(Part(r, p0, p1, pc.offset + p0 * pc.size, hi, hi))
        self.left = len(self.parts)
        # The front's last span when it rides with the part before it (``ride``).
        self.tail: tuple[Span, Future[bytes]] | None = None
        self.lead = lead  # its bytes asked for before its header was read

    def ride(self, front: list[Span], retry: Retry, have: int) -> None:
        """Lets the front's last span ride with the part that ends where it starts, one
        request instead of two, when every part goes in the first wave (no more parts
        than threads) and the span is one of the front's reads (at most part_bytes)
        past the ``have`` bytes read first: that part goes before the shard's others,
        and hands the span's bytes to the front."""
        if not self.parts or len(self.parts) > retry.parallel_parts or not front or self.lead:
            return
        lo, hi = front[-1]
        if hi - lo > retry.part_bytes or hi <= have:  # long, or in the first read already
            return
        last = next((p for p in self.parts if p.hi == lo), None)
        if last is None or hi != self.arriving.size:
            return
        last.end = hi
        self.tail = ((lo, hi), Future())

    def hand_tail(self, part: Part, data: bytes | None, error: BaseException | None = None) -> None:
        """Gives the front the bytes of its last span that came with ``part`` (or the
        error that ended the part: the front then reads them itself)."""
        if part.end == part.hi:
            return
        if data is not None:
            self.settle_tail(data[part.hi - part.lo :])
        else:
            self.settle_tail(None, error)

    def settle_tail(self, data: bytes | None, error: BaseException | None = None) -> None:
        """Ends the front's wait for its last span: its bytes, or an error (the part
        will not bring them: the shard failed, the supply closes)."""
        if self.tail is None:
            return
        with contextlib.suppress(InvalidStateError):  # settled already
            if data is not None:
                self.tail[1].set_result(data)
            else:
                self.tail[1].set_exception(error or FrontFailed("the part did not arrive"))

    def held(self) -> Held:
        """Its temporary file as a hold: the exclusive lock on it keeps it from eviction."""
        a = self.arriving
        return Held(a.tmp, a.fd, a.size)

    @contextlib.contextmanager
    def writer(self) -> Iterator[None]:
        """A write into the file: refused (FrontFailed) once the shard has failed, and
        waited for by ``failed`` before the file is closed."""
        with self.cond:
            if self.error is not None:
                raise FrontFailed(str(self.error))
            self.writing += 1
        try:
            yield
        finally:
            with self.cond:
                self.writing -= 1
                self.cond.notify_all()

    def fronted(self, reader: ShardReader, fronts: list[tuple[int, int, int]]) -> None:
        """The front is in and verified: the pieces' CRCs are known, parts can be checked."""
        for pc in self.pieced:
            got = reader.piece_crcs(pc.fdef.name)
            assert got is not None and got[0] == pc.size
            pc.crcs = got[1].copy()
            if pc.fdef.ragged:
                pc.offsets = reader.offsets(pc.fdef.name).copy()
        with self.cond:
            self.reader, self.fronts = reader, fronts
            self.cond.notify_all()

    def ranks(self, first: np.ndarray | None) -> list[int]:
        """Each part's rank in the fetch queue: the earliest position in this process's
        epoch at which a sample in it is read (``first``: per sample of the shard, its
        first read, UNREAD if none); all 0 (file order) without one. A ragged field's
        parts rank LATER until its offsets are known (the front)."""
        if first is None:
            return [0] * len(self.parts)
        need = [np.full(pc.count, UNREAD, np.int64) for pc in self.pieced]
        everyone = np.arange(self.num_samples, dtype=np.int64)
        for pc, want in zip(self.pieced, need, strict=True):
            if not pc.spans_known():
                want[:] = LATER
                continue
            pieces, owner = pc.pieces_of(everyone)
            np.minimum.at(want, pieces, first[owner])
        return [int(need[p.region][p.p0 : p.p1].min()) for p in self.parts]

    def missing(self, samples: np.ndarray, names: Sequence[str] | None) -> list[int]:
        """The parts not verified yet that hold bytes of ``samples`` in fields ``names``
        (None: every field); call under ``cond``."""
        out: set[int] = set()
        for pc in self.pieced:
            if names is not None and pc.fdef.name not in names:
                continue
            pieces, _ = pc.pieces_of(samples)
            out.update(np.unique(pc.part_of[pieces[~pc.verified[pieces]]]).tolist())
        return sorted(out)

    def check(self, part: Part) -> Callable[[bytes], str | None]:
        """A fetch check for ``part``: its length, then (once the front is in) each piece
        against its CRC; the part's CRC, composed from the pieces', is kept for the
        file's. FrontFailed when the front never came."""
        pc = self.pieced[part.region]

        def check(data: bytes) -> str | None:
            if len(data) != part.end - part.lo:
                return f"got {len(data)} bytes of the {part.end - part.lo} from {part.lo} (truncated transfer?)"
            self.hand_tail(part, data)  # before waiting for the front, which may wait for it
            with self.cond:
                while self.reader is None and self.error is None:
                    self.cond.wait(0.5)
                if self.error is not None:
                    raise FrontFailed(str(self.error))
            assert pc.crcs is not None
            view, crc = memoryview(data)[: part.hi - part.lo], 0
            for p in range(part.p0, part.p1):
                at = (p - part.p0) * pc.size
                piece = view[at : at + pc.size]
                got = crc32(piece)
                if got != int(pc.crcs[p]):
                    return (
                        f"field {pc.fdef.name!r} CRC piece {p} (bytes {part.lo + at}.."
                        f"{part.lo + at + len(piece)}): CRC-32 {got:#010x}, its header says "
                        f"{int(pc.crcs[p]):#010x} (corrupted transfer?)"
                    )
                crc = crc32_combine(crc, got, len(piece))
            part.crc = crc
            return None

        return check

    def file_crc(self) -> int:
        """The whole file's CRC-32, from its front spans' and parts' (all landed)."""
        return combined([*self.fronts, *((p.lo, p.hi, p.crc) for p in self.parts)])

    def whole_soon(self, timeout: float) -> bool:
        """Whether the shard lands (published) within ``timeout`` seconds, waited for only
        when every part is in already (its landing under way); False at once otherwise."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.done and self.error is None and self.left == 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))
            return self.done

    def wait_whole(self) -> None:
        with self.cond:
            while not self.done and self.error is None:
                self.cond.wait(0.5)
            if self.error is not None:
                raise self.error


def cut_at(pc: Pieced, cuts: list[int]) -> list[int]:
    """Where the parts of ``pc`` begin and end (piece numbers, 0 to its count) when its
    bytes arrive in lead ranges starting at ``cuts``: every part within one range, so
    that each waits for that range only, and a piece that a cut crosses a part alone."""
    bounds = {0, pc.count}
    for c in cuts:
        if pc.offset < c < pc.offset + pc.length:
            p, within = divmod(c - pc.offset, pc.size)
            bounds.update((p, p + 1) if within else (p,))
    return sorted(b for b in bounds if b <= pc.count)


def part_pieces(length: int, piece: int, retry: Retry) -> int:
    """Pieces a part of a data region of ``length`` bytes: the region cut into as many
    parts as run at once (``retry.parallel_parts``), each at least ``retry.part_bytes``
    and at most four times that. Fewer, longer reads cost less on a server that reads
    a whole object to answer a range of it, and no more on one that does not."""
    pieces = -(-length // piece)
    want = -(-pieces // max(1, retry.parallel_parts))  # as many parts as threads
    return max(1, min(max(retry.part_bytes // piece, want), 4 * retry.part_bytes // piece))


def combined(spans: Sequence[tuple[int, int, int]]) -> int:
    """The CRC-32 of spans (lo, hi, crc) that cover a file, composed in file order."""
    crc = 0
    for lo, hi, c in sorted(spans):
        crc = crc32_combine(crc, c, hi - lo)
    return crc


class FrontFailed(Exception):
    """A part's shard failed before its front was in: nothing to check the part with."""


def is_pieced(fl: FieldLayout) -> bool:
    return fl.crc_piece_bytes is not None and fl.regions["data"].length > 0


def fronts_of(layout: ShardLayout, size: int) -> list[Span]:
    """Every byte span of the file outside the pieced data regions, in file order."""
    data = [fl.regions["data"] for fl in layout.fields if is_pieced(fl)]
    return outside([(r.offset, r.end) for r in data], size)


def gaps_of(layout: ShardLayout, size: int, head: int) -> list[Span]:
    """The bytes no checksum but the whole file's covers: the padding after the header
    (its first ``head`` bytes) and between regions."""
    regions = [(r.offset, r.end) for fl in layout.fields for r in fl.regions.values()]
    return outside([(0, head), *regions], size)


def outside(spans: list[Span], size: int) -> list[Span]:
    """The spans of ``0..size`` that none of ``spans`` covers, in order."""
    out, at = [], 0
    for lo, hi in sorted(spans):
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < size:
        out.append((at, size))
    return out


def fetch_front(
    store: Storage,
    name: str,
    inc: Incoming,
    what: str,
    retry: Retry,
    whole_crc: int,
    first: tuple[bytes, ShardLayout],
) -> tuple[ShardReader, list[tuple[int, int, int]]]:
    """Fetches and writes the front of shard ``name`` into the file of ``inc``, tried again
    until it verifies (the module docstring): the shard mapped, and the (lo, hi, crc)
    of each front span. ``first``: its first bytes and layout (remote.fetch_head), whose
    bytes serve the first try. A shard that is all front (no pieces) is checked
    against ``whole_crc`` (the index's) too, before anything reads it."""
    url = store.name_url(name)
    head, layout = first
    arriving = inc.arriving
    size = arriving.size
    spans = [
        (a, min(a + retry.part_bytes, hi))
        for lo, hi in fronts_of(layout, size)
        for a in range(lo, hi, retry.part_bytes)
    ]
    tries = 0

    def once() -> tuple[ShardReader, list[tuple[int, int, int]]]:
        nonlocal tries
        have_head = head if tries == 0 else b""  # a later try reads every byte again
        tries += 1

        def land(span: Span) -> int:
            lo, hi = span
            with inc.cond:
                if inc.error is not None:  # a part failed the shard: nothing more to read
                    raise FrontFailed(str(inc.error))
            have = have_head[lo:hi] if lo < len(have_head) else b""
            if tries == 1 and inc.lead is not None and len(have) < hi - lo:
                lead = inc.lead.take(lo, hi)
                if lead is not None:  # in the file already: checked, not written again
                    return crc32(lead)
            if tries == 1 and inc.tail is not None and inc.tail[0] == span:
                try:  # the bytes come with the part before them (Incoming.ride)
                    have = inc.tail[1].result(timeout=TAIL_WAIT_S)
                except Exception:  # that part failed, or is slow: read them here
                    have = b""
            rest = store.read_once(name, lo + len(have), hi) if lo + len(have) < hi else b""
            if len(have) + len(rest) != hi - lo:
                raise Rejected(
                    f"got {len(have) + len(rest)} bytes of the {hi - lo} from {lo} (truncated transfer?)"
                )
            with inc.writer():
                write_at(arriving.fd, have, lo)
                write_at(arriving.fd, rest, lo + len(have))
            return crc32(rest, crc32(have))

        crcs = each_span(land, spans, retry)  # side by side, as a whole shard's parts
        try:
            reader = ShardReader(arriving.tmp, expected_bytes=size)  # header, metadata CRCs
        except FormatError as e:
            raise Rejected(str(e).replace(str(arriving.tmp), url)) from None
        if reader.layout != layout:
            reader.close()
            raise Rejected("its header changed between two reads (the object was replaced?)")
        for fl in layout.fields:
            data = fl.regions["data"]
            if not is_pieced(fl) and reader.region_crc(fl.field.name, "data") != data.crc32:
                reader.close()
                raise Rejected(
                    f"field {fl.field.name!r} data (bytes {data.offset}..{data.end}): CRC-32 "
                    "mismatch (corrupted transfer?)"
                )
        fronts = [(lo, hi, c) for (lo, hi), c in zip(spans, crcs, strict=True)]
        if not any(is_pieced(fl) for fl in layout.fields):
            crc = combined(fronts)
            if crc != whole_crc:
                reader.close()
                raise Rejected(
                    f"CRC-32 {crc:#010x}, index.json says {whole_crc:#010x} (corrupted transfer?)"
                )
        return reader, fronts

    return retrying(once, what, url, retry, give_up=(FrontFailed,))


class PartQueue:
    """Part fetches of one process, run on ``threads`` threads, lowest rank first."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self.cond = threading.Condition()
        self.heap: list[tuple[int, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.running: list[threading.Thread] = []
        self.closed = False

    def put(self, jobs: Sequence[tuple[int, Callable[[], None]]]) -> bool:
        """Queues ``jobs`` (rank, job); False once closed (nothing queued)."""
        with self.cond:
            if self.closed:
                return False
            for rank, job in jobs:
                heapq.heappush(self.heap, (rank, next(self.seq), job))
            while len(self.running) < self.threads:
                t = threading.Thread(target=self.run, name="dlop-part", daemon=True)
                self.running.append(t)
                t.start()
            self.cond.notify_all()
        return True

    def run(self) -> None:
        while True:
            with self.cond:
                while not self.heap and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                _, _, job = heapq.heappop(self.heap)
            try:
                job()
            except Exception:  # a job reports its own failure; the thread serves on
                traceback.print_exc()

    def close(self, wait_s: float) -> list[Callable[[], None]]:
        """Stops the threads once their current part is done, waiting for them at most
        ``wait_s`` seconds; returns the queued jobs, dropped. A thread still inside a
        network read after that (a stalled server: up to the read timeout) is a daemon,
        left to end with its read: whatever it brings is refused by its shard, which its
        supply's close failed (Incoming.writer, Lead.write)."""
        with self.cond:
            self.closed = True
            dropped = [job for _, _, job in self.heap]
            self.heap.clear()
            self.cond.notify_all()
            running, self.running = self.running, []
        me = threading.current_thread()
        deadline = time.monotonic() + wait_s
        for t in running:
            if t is not me:
                t.join(max(0.0, deadline - time.monotonic()))
        return dropped


def first_reads(flat: np.ndarray, lo: int, hi: int, positions: np.ndarray) -> np.ndarray:
    """Per sample of the shard holding global samples ``lo:hi``, the first position in
    ``flat`` (this process's epoch, in read order) that reads it; ``positions``: the
    positions reading the shard, ascending."""
    first = np.full(hi - lo, UNREAD, np.int64)
    local = flat[positions] - lo
    seen, at = np.unique(local, return_index=True)
    first[seen] = positions[at]
    return first

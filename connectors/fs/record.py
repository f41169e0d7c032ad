"""The ``file://`` connector's on-disk record: a small header, the key, then the object bytes.

Layout (little-endian)::

    offset 0   magic b"KVGD"
           4   version u8 (1 or 2), flags u8 (0)
           6   pad u16 (version 1: 0)
           8   key_len u32
          12   data_len u64
          20   check u32 = xxh32(bytes 0..20 + key bytes)
          24   key, UTF-8 (lone surrogates kept with "surrogatepass"), key_len bytes
               pad zero bytes (version 2)
               data, data_len bytes

Version 2 exists for ``direct_io`` puts: the pad puts the object's last part (its payload) on
a DIO_ALIGN boundary of the file, so that O_DIRECT can write it straight from its page-aligned
slab. Buffered puts still write version 1 (the bytes of version 1's reserved field are now
flags and pad, and were always written as zeros).

The key is inside the file so that the index can be rebuilt from headers alone and so that a
file reached through a hash collision is recognised as another key's (a miss, not wrong data).
The data bytes are not checked here: the frame above the connector carries their checksum.

All functions here block; the connector runs them in worker threads. Long reads and writes go
in chunks and check a ``stop`` event between chunks, so that a cancelled caller can be told to
stop touching its buffers quickly.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import struct
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import xxhash

from gateway.connector import PLACEMENT, FillHook, address_of

MAGIC = b"KVGD"
VERSION = 1
VERSION_PADDED = 2
_FIXED = struct.Struct("<4sBBHIQ")
_CHECK = struct.Struct("<I")
HEADER_LEN = _FIXED.size + _CHECK.size  # 24
SUFFIX = ".kvo"
# Keys are short strings; a larger key_len can only come from a mangled header.
MAX_KEY_LEN = 1 << 20
# One syscall moves at most this much, so a stop request waits for one chunk at most.
CHUNK = 16 << 20
READ_STEP = 1 << 20  # parallel reads take steps of this size (see Steps)
# An O_DIRECT read waits for the disk, and the disk here is fast only with many requests in
# flight: one call of 32 MiB (eight 4 MiB requests at once) is what the raw baseline does. So
# pieces read in place are large, one call each (in get ratios against that baseline, pieces of
# 32 MiB in two threads had a median of 0.74, 16 MiB 0.61, 8 MiB in four threads 0.46, 4 MiB
# 0.56: three rounds each, swinging 0.36-0.89 between rounds). Pieces that go through a bounce
# buffer (a phase that does not match) are smaller, to bound the buffer each thread keeps.
DIRECT_READ_STEP = 32 << 20
BOUNCE_STEP = 1 << 20
# Well under IOV_MAX (1024 on Linux).
_MAX_IOV = 512
# O_DIRECT needs file offsets, lengths and memory aligned to the device's logical block (512
# here, 4096 on 4Kn disks); a page satisfies every device. The allocator's ``placed`` phases
# are taken modulo the same page.
DIO_ALIGN = PLACEMENT


class BadRecord(Exception):
    """The file is not a whole record (bad magic, checksum, version or length)."""


class ForeignRecord(Exception):
    """A valid record of another key (a hash collision, or a file moved by hand)."""


class Stopped(Exception):
    """The caller gave up (was cancelled); the work stopped between two chunks."""


class Record(NamedTuple):
    key: str
    data_offset: int
    data_len: int
    mtime_ns: int
    pad: int = 0  # zero bytes before the data (version 2)


def encode_key(key: str) -> bytes:
    return key.encode("utf-8", "surrogatepass")


def object_name(key: str) -> tuple[str, str, str]:
    """(fan-out dir, fan-out subdir, file name) of ``key``: hex digits only, whatever the key."""
    digest = hashlib.blake2b(encode_key(key), digest_size=20).hexdigest()
    return digest[:2], digest[2:4], digest + SUFFIX


def _check(fixed: bytes, key_bytes: bytes) -> int:
    h = xxhash.xxh32(fixed)
    h.update(key_bytes)
    return int(h.intdigest())


def pack_head(key: str, data_len: int, pad: int = 0) -> bytes:
    """The header and the key: everything in the file before the data, but the ``pad`` zero
    bytes (version 2 when there are any)."""
    key_bytes = encode_key(key)
    version = VERSION if pad == 0 else VERSION_PADDED
    fixed = _FIXED.pack(MAGIC, version, 0, pad, len(key_bytes), data_len)
    return fixed + _CHECK.pack(_check(fixed, key_bytes)) + key_bytes


def pad_for(head_len: int, lead_len: int) -> int:
    """Zero bytes after a ``head_len`` head that put ``lead_len`` further bytes of data just
    before a DIO_ALIGN boundary (where the last part then starts)."""
    return -(head_len + lead_len) % DIO_ALIGN


def read_record(fd: int) -> Record:
    """Read and check the header and key of the record open at ``fd``; raises BadRecord."""
    head = os.pread(fd, HEADER_LEN, 0)
    record = parse_record(head, lambda n, at: os.pread(fd, n, at))
    st = os.fstat(fd)
    check_length(record, st.st_size)
    return record._replace(mtime_ns=st.st_mtime_ns)


def check_length(record: Record, file_size: int) -> None:
    if file_size != record.data_offset + record.data_len:
        end = record.data_offset + record.data_len
        raise BadRecord(f"file has {file_size} bytes, its header says {end}")


def parse_record(head: bytes, read: Callable[[int, int], bytes]) -> Record:
    """Check a record's header (``head``, at least its fixed part) and key (``read(n, at)``
    gives ``n`` bytes of the file at offset ``at``); raises BadRecord. The file's length is
    not checked (``check_length``), and ``mtime_ns`` is left 0."""
    if len(head) < HEADER_LEN:
        raise BadRecord(f"short header ({len(head)} bytes)")
    magic, version, flags, pad, key_len, data_len = _FIXED.unpack_from(head)
    if magic != MAGIC:
        raise BadRecord(f"bad magic {magic!r}")
    if version not in (VERSION, VERSION_PADDED) or flags != 0:
        raise BadRecord(f"unknown record version {version} (flags {flags})")
    if (pad != 0) != (version == VERSION_PADDED):
        raise BadRecord(f"version {version} record with {pad} bytes of padding")
    if key_len > MAX_KEY_LEN:
        raise BadRecord(f"key length {key_len} is implausible")
    key_bytes = read(key_len, HEADER_LEN)
    if (
        len(key_bytes) != key_len
        or _check(head[: _FIXED.size], key_bytes) != _CHECK.unpack_from(head, _FIXED.size)[0]
    ):
        raise BadRecord("header checksum mismatch")
    data_offset = HEADER_LEN + key_len + pad
    try:
        key = key_bytes.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise BadRecord("key is not UTF-8") from exc
    return Record(key, data_offset, data_len, 0, pad)


def read_padded(
    fd: int, key: str, buf: memoryview, phase: int, filled: FillHook | None = None
) -> None:
    """Read the padded (version 2) record of ``key`` open at ``fd`` with O_DIRECT, its data
    into ``buf`` (its length as the index says), in one ``preadv`` from offset 0.

    Why one call: the header read by itself (``record_of``) and the data's partial first and
    last blocks each cost a request to the disk, which nothing of a file written with O_DIRECT
    has in the page cache: at 1 MiB, four requests instead of the one a raw read makes. Here
    the head's blocks and the last block land in this thread's bounce buffer and the whole
    blocks between them in ``buf``, which the index's ``phase`` (the data's offset in a block)
    placed at that phase; the header is checked after the read, against the file length the
    read found. ``buf`` must be ``placed_for`` the record; raises what ``record_of`` does, or
    ``SizeChanged`` for another record of the key.
    """
    data_offset, lead, first, middle = _padded_layout(key, buf.nbytes, phase)
    if not placed_for(key, buf, phase):
        raise ValueError("the buffer is not placed at the record's phase")
    bounce = _bounce(lead + 2 * DIO_ALIGN)
    # One block past the data's end too: a file longer than its header says reads longer.
    tail = bounce[lead : lead + 2 * DIO_ALIGN]
    got = os.preadv(fd, [bounce[:lead], buf[first : first + middle], tail], 0)
    if got < HEADER_LEN:
        raise BadRecord(f"short header ({got} bytes)")
    head = bytes(bounce[: min(got, lead)])
    record = parse_record(head, lambda n, at: head[at : at + n])
    if record.key != key:
        raise ForeignRecord(f"the file of {key!r} holds another key")
    if record.data_len != buf.nbytes or record.data_offset != data_offset:
        raise SizeChanged(record.data_len)  # before the length: a longer record reads cut
    check_length(record, got)
    rest = buf.nbytes - first - middle
    buf[:first] = bounce[data_offset:lead]
    buf[first + middle :] = tail[:rest]
    if filled is not None:
        filled(0, buf.nbytes)


def placed_for(key: str, buf: memoryview, phase: int) -> bool:
    """Whether ``read_padded`` can read the padded record of ``key`` at ``phase`` into ``buf``:
    its whole blocks land in place, and there is at least one."""
    _, _, first, middle = _padded_layout(key, buf.nbytes, phase)
    return middle > 0 and (address_of(buf) + first) % DIO_ALIGN == 0


def _padded_layout(key: str, size: int, phase: int) -> tuple[int, int, int, int]:
    """(data offset, head blocks' length, data bytes in the last of them, whole blocks of data
    after them) of a padded record of ``key`` holding ``size`` bytes at ``phase``."""
    head_len = HEADER_LEN + len(encode_key(key))
    data_offset = head_len + (phase - head_len) % DIO_ALIGN  # the pad is under a block
    lead = data_offset + (-data_offset % DIO_ALIGN)
    first = lead - data_offset
    middle = (size - first) // DIO_ALIGN * DIO_ALIGN if size > first else 0
    return data_offset, lead, first, middle


class SizeChanged(Exception):
    """The file holds another record than the index said: a put replaced it meanwhile."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


def record_of(fd: int, key: str) -> Record:
    """Read the header at ``fd`` and check that it is a whole record of ``key``."""
    record = read_record(fd)
    if record.key != key:
        raise ForeignRecord(f"the file of {key!r} holds another key")
    return record


def read_exact(
    fd: int, buf: memoryview, offset: int, stop: threading.Event, chunk: int = CHUNK
) -> None:
    """Fill ``buf`` from ``fd`` at ``offset``, ``chunk`` bytes per call at most; a file that
    ends early is a BadRecord."""
    pos, total = 0, buf.nbytes
    while pos < total:
        if stop.is_set():
            raise Stopped
        n = os.preadv(fd, [buf[pos : pos + chunk]], offset + pos)
        if n == 0:
            raise BadRecord(f"file ended {total - pos} bytes early")
        pos += n


class Steps:
    """Hands out the pieces of a buffer, in order, to several reading threads: (start, stop,
    bounce), where ``bounce`` says the piece goes through a DirectReader.

    Threads that take interleaved steps read the same region of memory at once, so a checksum
    that follows in order (``filled``) finds each step still in the shared L3 cache; measured
    on a 32 MiB get, that is 11.6-13.8 GB/s against 8.3-10.3 for two halves.
    """

    def __init__(self, pieces: list[tuple[int, int, bool]]) -> None:
        self._pieces = pieces
        self._next = 0
        self._lock = threading.Lock()

    @classmethod
    def even(cls, total: int, step: int = READ_STEP) -> Steps:
        """``step``-sized pieces of a ``total``-byte buffer, read as they are."""
        return cls([(s, min(total, s + step), False) for s in range(0, total, step)])

    @classmethod
    def direct(cls, buf: memoryview, offset: int, step: int = DIRECT_READ_STEP) -> Steps:
        """Pieces of an O_DIRECT read of ``buf`` from file ``offset`` on.

        Where ``buf``'s address has the file offset's phase in a block, the whole blocks in
        the middle are read in place (the disk fills ``buf``), and only the partial blocks at
        either end go through a bounce buffer; otherwise every piece does.
        """
        total = buf.nbytes
        if total == 0 or (address_of(buf) - offset) % DIO_ALIGN:
            return cls(
                [(s, min(total, s + BOUNCE_STEP), True) for s in range(0, total, BOUNCE_STEP)]
            )
        first = min(total, -offset % DIO_ALIGN)
        last = first + (total - first) // DIO_ALIGN * DIO_ALIGN
        pieces = [(0, first, True)] if first else []
        pieces += [(s, min(last, s + step), False) for s in range(first, last, step)]
        if last < total:
            pieces.append((last, total, True))
        return cls(pieces)

    def take(self) -> tuple[int, int, bool] | None:
        with self._lock:
            if self._next >= len(self._pieces):
                return None
            self._next += 1
            return self._pieces[self._next - 1]


def read_steps(
    fd: int,
    buf: memoryview,
    offset: int,
    steps: Steps,
    stop: threading.Event,
    filled: FillHook | None = None,
) -> None:
    """Read the steps this thread takes from ``steps`` into ``buf`` (from ``fd`` at
    ``offset``), reporting each one done to ``filled`` (see ``gateway.connector.Allocator``)."""
    while (step := steps.take()) is not None:
        start, end, bounce = step
        if bounce:
            _direct_reader().read_into(fd, buf[start:end], offset + start, stop)
        else:  # a DIRECT_READ_STEP piece in one call (READ_STEP for buffered reads anyway)
            read_exact(fd, buf[start:end], offset + start, stop, DIRECT_READ_STEP)
        if filled is not None:
            filled(start, end)


def write_all(fd: int, parts: Sequence[memoryview], stop: threading.Event) -> None:
    """Write the concatenation of ``parts`` with ``os.writev``, without joining them.

    Each call takes at most CHUNK bytes and _MAX_IOV buffers; a partial write puts the unwritten
    rest back at the front of the queue.
    """
    pending = deque(p for p in parts if p.nbytes)
    while pending:
        if stop.is_set():
            raise Stopped
        iov: list[memoryview] = []
        size = 0
        while pending and len(iov) < _MAX_IOV and size < CHUNK:
            part = pending.popleft()
            take = min(part.nbytes, CHUNK - size)
            if take < part.nbytes:
                pending.appendleft(part[take:])
                part = part[:take]
            iov.append(part)
            size += take
        written = os.writev(fd, iov)
        if written < size:
            rest = []
            for part in iov:
                if written >= part.nbytes:
                    written -= part.nbytes
                    continue
                rest.append(part[written:])
                written = 0
            pending.extendleft(reversed(rest))


def is_aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can take ``view`` as it is: contiguous, at a DIO_ALIGN-aligned address."""
    return view.nbytes > 0 and view.c_contiguous and address_of(view) % DIO_ALIGN == 0


def _pwrite_all(fd: int, view: memoryview, offset: int, stop: threading.Event) -> None:
    pos = 0
    while pos < view.nbytes:
        if stop.is_set():
            raise Stopped
        piece = view[pos : pos + CHUNK]
        written = os.pwrite(fd, piece, offset + pos)
        if written < piece.nbytes:  # the rest would start off a block boundary: EINVAL
            raise OSError(errno.ENOSPC, f"O_DIRECT wrote {written} of {piece.nbytes} bytes")
        pos += written


def write_direct(
    fd: int, lead: Sequence[memoryview], body: memoryview, stop: threading.Event
) -> None:
    """Write ``lead`` then ``body`` to ``fd``, a new file opened with O_DIRECT, exactly
    ``lead`` + ``body`` bytes long in the end.

    ``lead`` (the head, its pad and any data parts before the last) is a DIO_ALIGN multiple
    long, and ``body`` starts at an aligned address: body's whole blocks go to the disk straight
    from its memory, the first CHUNK of them in one call with the lead (``pwritev``). The lead
    and body's last partial block go through a page-aligned bounce buffer that each thread
    keeps, zero-padded to a block; a truncate then drops that padding (without a partial
    block, the new file is already as long as what was written). At 1 MiB a record, that is a
    write, an ``mmap`` and a truncate less per record: see ``BOUNCE`` below.
    """
    lead_len = sum(p.nbytes for p in lead)
    if lead_len % DIO_ALIGN or not is_aligned(body):
        raise ValueError("write_direct needs an aligned lead length and body address")
    full = body.nbytes - body.nbytes % DIO_ALIGN
    tail = body.nbytes - full
    bounce = _bounce(lead_len + DIO_ALIGN)
    pos = 0
    for part in lead:
        bounce[pos : pos + part.nbytes] = part
        pos += part.nbytes
    first = min(full, CHUNK)
    if stop.is_set():
        raise Stopped
    pieces = [bounce[:lead_len], body[:first]] if first else [bounce[:lead_len]]
    written = os.pwritev(fd, pieces, 0)
    if written < lead_len + first:  # the rest would start off a block boundary: EINVAL
        raise OSError(errno.ENOSPC, f"O_DIRECT wrote {written} of {lead_len + first} bytes")
    _pwrite_all(fd, body[first:full], lead_len + first, stop)
    if tail:
        bounce[:tail] = body[full:]
        bounce[tail:DIO_ALIGN] = bytes(DIO_ALIGN - tail)
        _pwrite_all(fd, bounce[:DIO_ALIGN], lead_len + full, stop)
        os.ftruncate(fd, lead_len + body.nbytes)


class _Bounce(threading.local):
    buffer: memoryview | None = None


KEEP_BOUNCE = 1 << 20
BOUNCE = _Bounce()
"""Each writing thread's bounce buffer for ``write_direct``, kept between records: a new
mapping per record cost an ``mmap``, a ``munmap`` and a page fault each time (the disk tier
wrote 1 MiB records at 0.45x raw O_DIRECT writes, with 16 system calls a record)."""


def _bounce(nbytes: int) -> memoryview:
    """A page-aligned bounce buffer at least ``nbytes`` long: this thread's, kept between
    records when it is at most ``KEEP_BOUNCE`` (a lead with data parts before the last can be
    far larger, and is not kept). Never closed: an error's traceback may still hold views."""
    buffer = BOUNCE.buffer
    if buffer is not None and buffer.nbytes >= nbytes:
        return buffer
    size = -(-max(nbytes, 64 << 10) // mmap.PAGESIZE) * mmap.PAGESIZE
    buffer = memoryview(mmap.mmap(-1, size))
    if size <= KEEP_BOUNCE:
        BOUNCE.buffer = buffer
    return buffer


class DirectReader:
    """Reads byte ranges of a file opened with O_DIRECT, through a page-aligned buffer of its
    own: the range is widened to whole blocks, read, and the asked-for bytes copied out. One
    per reading thread."""

    def __init__(self, step: int) -> None:
        self._map = mmap.mmap(-1, step + 2 * DIO_ALIGN)
        self._bounce = memoryview(self._map)

    def read_into(self, fd: int, buf: memoryview, offset: int, stop: threading.Event) -> None:
        """Fill ``buf`` (at most ``step`` bytes) from ``fd`` at ``offset``."""
        if stop.is_set():
            raise Stopped
        first = offset - offset % DIO_ALIGN
        end = offset + buf.nbytes
        last = end + (-end % DIO_ALIGN)
        window = self._bounce[: last - first]
        got = 0
        while got < end - first:  # a short read happens only at the end of the file
            n = os.preadv(fd, [window[got:]], first + got)
            if n == 0:
                raise BadRecord(f"file ended {end - first - got} bytes early")
            got += n
        buf[:] = window[offset - first : end - first]


_THREAD_STATE = threading.local()


def _direct_reader() -> DirectReader:
    """This thread's DirectReader (a BOUNCE_STEP buffer kept for the thread's lifetime)."""
    reader: DirectReader | None = getattr(_THREAD_STATE, "direct_reader", None)
    if reader is None:
        reader = _THREAD_STATE.direct_reader = DirectReader(BOUNCE_STEP)
    return reader

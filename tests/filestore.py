"""Editing a stopped nats-server's file store, the way an intruder with disk access would.

A message block (``msgs/<n>.blk``) is a run of records: ``rl`` (u32 LE, the
record's whole length, high bit set when it has headers), ``seq`` (u64),
``ts`` (i64), the subject length (u16), the subject, the headers (u32 length
+ bytes) when flagged, the payload, and an 8-byte hash. ``index.db`` holds the
stream's cached state; removing it makes the server rebuild the state from
the blocks at start.
"""

from __future__ import annotations

import struct
from pathlib import Path

_HDR = struct.Struct("<IQqH")
_HBIT = 1 << 31


def stream_dir(store: Path, stream: str) -> Path:
    """The stream's folder under a server's ``store_dir`` (global account)."""
    found = list(Path(store).rglob(f"streams/{stream}"))
    assert found, f"no file store for {stream} under {store}"
    return found[0]


def records(blk: Path) -> list[tuple[int, int, int]]:
    """(offset, length, seq) of every record of a block, in file order."""
    data = blk.read_bytes()
    out, off = [], 0
    while off + _HDR.size <= len(data):
        rl, seq, _ts, _sl = _HDR.unpack_from(data, off)
        n = rl & ~_HBIT
        if n == 0:
            break
        out.append((off, n, seq & ~(1 << 63)))
        off += n
    return out


def truncate_last(store: Path, stream: str, count: int) -> list[int]:
    """Cut the last ``count`` records off the stream's last block and drop its index; their seqs."""
    msgs = stream_dir(store, stream) / "msgs"
    blk = max(msgs.glob("*.blk"), key=lambda p: int(p.stem))
    recs = records(blk)
    cut = recs[-count:]
    with open(blk, "r+b") as f:
        f.truncate(cut[0][0])
    for idx in msgs.glob("index.db"):
        idx.unlink()
    return [seq for _o, _n, seq in cut]

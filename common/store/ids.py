"""The shapes of ids that become part of a key name or a stream position."""
from __future__ import annotations

import re

# Ids are checked by shape before they become part of a key name: "seq-<id>:events" names a
# stream, not a record, and a newline or a 23-digit stream id makes Redis itself fail.
_SEQ_ID = re.compile(r"seq-[0-9a-f]{32}")
_STREAM_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")   # ASCII digits only
_U64 = 2**64 - 1


def is_seq_id(seq_id: str) -> bool:
    return bool(_SEQ_ID.fullmatch(seq_id))


def valid_stream_id(entry_id: str) -> bool:
    """A Redis stream entry id (<ms>-<seq>, both 64-bit unsigned), the SSE resume position."""
    m = _STREAM_ID.fullmatch(entry_id)
    return bool(m) and int(m[1]) <= _U64 and int(m[2]) <= _U64

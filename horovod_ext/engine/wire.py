"""The cycle message each rank sends over the control plane once per negotiation round.

Layout: flags, the number of cache ids, the ids (int32), then the pickled pair (announcements,
aborts) when there are any.  Binary, since the steady state (cache ids only) recurs every step
and must cost little to build and compare.  Announcements travel as ``(name, plain tuple)``:
a ``RequestMeta`` would pickle its class path along, making every announcement longer and tying
the bytes to where the class lives.
"""
import pickle
import struct
from typing import List, NamedTuple, Sequence, Tuple

from .requests import RequestMeta

_HEADER = struct.Struct("<BI")
_SHUTDOWN_FLAG, _EXTRA_FLAG = 1, 2

Announcement = Tuple[str, RequestMeta]


class Message(NamedTuple):
    """One rank's cycle message, decoded."""
    cache_ids: Tuple[int, ...]           # requests announced before, by response-cache id
    announce: List[Announcement]         # requests described in full
    shutdown: bool                       # the rank is shutting down
    aborts: List[str]                    # names rank 0 gives up on (stalled)


def encode(cache_ids: Sequence[int], announce: List[Announcement], shutdown: bool,
           aborts: List[str]) -> bytes:
    extra = bool(announce or aborts)
    flags = (_SHUTDOWN_FLAG if shutdown else 0) | (_EXTRA_FLAG if extra else 0)
    message = _HEADER.pack(flags, len(cache_ids)) + struct.pack(f"<{len(cache_ids)}i", *cache_ids)
    if extra:
        plain = [(name, tuple(meta)) for name, meta in announce]
        message += pickle.dumps((plain, aborts), protocol=pickle.HIGHEST_PROTOCOL)
    return message


def decode(message: bytes) -> Message:
    flags, count = _HEADER.unpack_from(message)
    ids = struct.unpack_from(f"<{count}i", message, _HEADER.size)
    announce, aborts = [], []
    if flags & _EXTRA_FLAG:
        plain, aborts = pickle.loads(message[_HEADER.size + 4 * count:])
        announce = [(name, RequestMeta._make(meta)) for name, meta in plain]
    return Message(ids, announce, bool(flags & _SHUTDOWN_FLAG), aborts)

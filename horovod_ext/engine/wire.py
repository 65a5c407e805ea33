"""The cycle message each rank sends over the control plane once per negotiation round.

Layout: flags, the number of cache ids, the ids (int32), then the pickled pair (announcements,
aborts) when there are any.  A flag says that a caller on this rank has been blocked for a while
(the deadlock check needs to know when every rank waits).  Binary, since the steady state (cache ids only) recurs every step
and must cost little to build and compare.  Announcements travel as ``(name, plain tuple)``:
a ``RequestMeta`` would pickle its class path along, making every announcement longer and tying
the bytes to where the class lives.
"""
import pickle
import struct
from typing import List, NamedTuple, Sequence, Tuple

from .requests import RequestMeta

_HEADER = struct.Struct("<BI")
_SHUTDOWN_FLAG, _EXTRA_FLAG, _WAITING_FLAG = 1, 2, 4

Announcement = Tuple[str, RequestMeta]


class Message(NamedTuple):
    """One rank's cycle message, decoded."""
    cache_ids: Tuple[int, ...]           # requests announced before, by response-cache id
    announce: List[Announcement]         # requests described in full
    shutdown: bool                       # the rank is shutting down
    aborts: List[Tuple[str, str]]        # (name, reason) rank 0 gives up on (stalled, deadlocked)
    waiting: bool = False                # a caller has been blocked on this rank for a while


def encode(cache_ids: Sequence[int], announce: List[Announcement], shutdown: bool,
           aborts: List[Tuple[str, str]], waiting: bool = False) -> bytes:
    extra = bool(announce or aborts)
    flags = ((_SHUTDOWN_FLAG if shutdown else 0) | (_EXTRA_FLAG if extra else 0)
             | (_WAITING_FLAG if waiting else 0))
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
    return Message(ids, announce, bool(flags & _SHUTDOWN_FLAG), aborts,
                   bool(flags & _WAITING_FLAG))

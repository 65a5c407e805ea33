"""The files behind the in-node shared-memory segment (shm.py): making one with its pages
reserved, how much room a directory leaves each local rank, and whether a peer's process lives.

tmpfs hands out a page at its first write, and a write past the file system's size kills the
writer with SIGBUS, with no word of why.  So a segment's pages are reserved when it is made, and
the local ranks agree at start-up on the room each may have (``room_per_rank``): a buffer whose
slot would not fit goes through the transport instead (topology.py), and a segment that still
does not fit (the directory filled up since) fails on every local rank alike, saying what to
change.
"""
import errno
import os
import uuid
from typing import Optional, Tuple

MIB = 1 << 20                     # a segment's slots are whole MiB
LINE = 64                         # one counter per cache line


def header_bytes(ranks: int) -> int:
    """The segment's header: a progress counter and a process id per rank, a line each."""
    return 2 * ranks * LINE


def slot_bytes(nbytes: int) -> int:
    """A slot's size for a buffer of ``nbytes``: whole MiB, and no more (every page is
    reserved up front)."""
    return -(-max(nbytes, 1) // MIB) * MIB


def room_per_rank(directory: str, ranks: int) -> int:
    """The largest slot (whole MiB) a segment of ``ranks`` slots may have in ``directory``, from
    the room free there now; 0 where it cannot be told."""
    try:
        stat = os.statvfs(directory)
    except OSError:
        return 0
    free = stat.f_bavail * stat.f_frsize - header_bytes(ranks)
    return max(0, free // ranks // MIB * MIB)


def create(directory: str, size: int, ranks: int,
           capacity: int) -> Tuple[Optional[str], Optional[str]]:
    """A new segment file of ``size`` bytes in ``directory``, its pages reserved: (its path,
    None), or (None, why it cannot be made)."""
    name = os.path.join(directory, f"horovod_ext-{os.getpid()}-{uuid.uuid4().hex}")
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return name, None        # a file system that cannot reserve: pages as written
        os.unlink(name)
        stat = os.statvfs(directory)
        return None, (f"the in-node shared-memory segment needs {size / MIB:.0f} MiB "
                      f"({ranks} local ranks x {capacity / MIB:.0f} MiB) and {directory} "
                      f"has {stat.f_bavail * stat.f_frsize / MIB:.0f} MiB free "
                      f"({os.strerror(exc.errno)}): give {directory} more room (docker run "
                      f"--shm-size=..., or --ipc=host), or set HOROVOD_SHARED_MEMORY=0 to "
                      f"reduce through the transport instead")
    finally:
        os.close(fd)
    return name, None


def alive(pid: int) -> bool:
    """False once ``pid`` has exited, zombie included (its parent may not have reaped it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return True   # cannot tell: the timeout still applies

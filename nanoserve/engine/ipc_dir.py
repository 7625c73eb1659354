"""The private folder of a server's ZeroMQ ipc sockets, and the removal of folders whose server died.

A server removes its folder when it stops. One killed outright (SIGKILL, the OOM killer) cannot,
and its folder stayed in the temporary folder for good. Each folder therefore holds a `lock`
file that its creating process keeps locked (flock) for as long as it lives; the kernel drops the
lock when that process dies, however it dies. A new folder's creator removes the folders beside
it whose lock it can take. A process id would not do: a server in another PID namespace that
shares /tmp has ids this process cannot see, and a reused id would keep a dead folder for good.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile

import zmq

logger = logging.getLogger(__name__)

PREFIX = "nanoserve-"
LOCK = "lock"
_IPC_PATH_MAX = getattr(zmq, "IPC_PATH_MAX_LEN", 0) or 107   # bytes of a Unix socket's path (sun_path)
_held: dict[str, int] = {}   # folder -> the descriptor whose lock marks it alive


def socket_dir(longest_name: str) -> str:
    """A new private folder for ZeroMQ ipc sockets, the longest named `longest_name`: in the
    temporary folder (TMPDIR), or in /tmp where a socket's path there would pass the kernel's limit.
    A batch job's or CI runner's TMPDIR can be that deep, and no socket in it could bind.
    Folders of dead servers beside it are removed first."""
    parent = tempfile.gettempdir()
    if len(os.fsencode(os.path.join(parent, PREFIX + "x" * 8, longest_name))) > _IPC_PATH_MAX:
        parent = "/tmp"
    remove_dead_folders(parent)
    folder = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
    _hold(folder)
    return folder


def remove_socket_dir(folder: str) -> None:
    """Remove a folder made by socket_dir, and let go of its lock."""
    shutil.rmtree(folder, ignore_errors=True)
    fd = _held.pop(folder, None)
    if fd is not None:
        os.close(fd)


def remove_dead_folders(parent: str) -> None:
    """Remove this user's socket folders in `parent` whose lock no process holds. A folder without
    a lock file is left alone: it is being made (the lock appears already held), or it was made by
    a version that wrote none."""
    try:
        names = [name for name in os.listdir(parent) if name.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        folder = os.path.join(parent, name)
        if folder in _held:
            continue
        try:
            fd = os.open(os.path.join(folder, LOCK), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.getuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:   # held: its server is alive (or this filesystem has no flock)
            continue
        finally:
            os.close(fd)   # the lock taken (if any) goes with it: the folder is removed next either way
        shutil.rmtree(folder, ignore_errors=True)
        logger.info("Removed %s, left by a server that did not stop", folder)


def _hold(folder: str) -> None:
    """Lock `folder`'s lock file for this process's lifetime. The file is locked under another name
    and then renamed, so a lock file that another server finds is always one already held."""
    staging = os.path.join(folder, LOCK + ".new")
    fd = os.open(staging, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:   # no flock here: the folder is still removed when this server stops
        os.close(fd)
        os.remove(staging)
        return
    os.rename(staging, os.path.join(folder, LOCK))
    _held[folder] = fd

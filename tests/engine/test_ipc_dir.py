"""Socket folders of dead servers are removed by the next server, and only those: a live server's
folder, one being made, and another user's stay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

from nanoserve.engine import ipc_dir

OWNER = """
import sys, tempfile, time
tempfile.tempdir = sys.argv[1]
from nanoserve.engine.ipc_dir import socket_dir
print(socket_dir("output"), flush=True)
time.sleep(600)
"""


def owner(parent) -> tuple[subprocess.Popen, str]:
    """A process that made a socket folder in `parent` and lives on, and that folder."""
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(parent)], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_dead_servers_folder_goes_and_a_live_ones_stays(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    live, live_dir = owner(tmp_path)
    dead, dead_dir = owner(tmp_path)
    try:
        assert os.path.isdir(live_dir) and os.path.isdir(dead_dir)
        assert sorted(os.listdir(dead_dir)) == ["lock"]
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        unlocked = tmp_path / "nanoserve-older"   # no lock file: a folder being made, or an older version's
        unlocked.mkdir()
        other = tmp_path / "something-else"
        other.mkdir()
        (other / "lock").touch()

        mine = ipc_dir.socket_dir("output")
        assert not os.path.exists(dead_dir)
        assert os.path.isdir(live_dir) and os.path.isdir(unlocked) and os.path.isdir(other)
        # a second sweep while both live changes nothing: this process's own lock is held too
        ipc_dir.remove_dead_folders(str(tmp_path))
        assert os.path.isdir(mine) and os.path.isdir(live_dir)
        ipc_dir.remove_socket_dir(mine)
        assert not os.path.exists(mine) and mine not in ipc_dir._held
    finally:
        live.kill()
        live.wait(10)
    ipc_dir.remove_dead_folders(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nanoserve-older", "something-else"]


def test_a_folder_whose_lock_file_is_a_link_is_left_alone(tmp_path):
    # the lock is opened without following links: another user's link must not make this process
    # lock (or judge) a file it points at
    folder = tmp_path / "nanoserve-linked"
    folder.mkdir()
    target = tmp_path / "target"
    target.touch()
    (folder / "lock").symlink_to(target)
    ipc_dir.remove_dead_folders(str(tmp_path))
    assert folder.is_dir()


def test_a_deep_temporary_folder_falls_back_to_tmp(tmp_path, monkeypatch):
    deep = tmp_path / ("t" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    folder = ipc_dir.socket_dir("output-63")
    try:
        assert os.path.dirname(folder) == "/tmp"
        assert len(os.fsencode(os.path.join(folder, "output-63"))) <= 107
    finally:
        ipc_dir.remove_socket_dir(folder)
    assert not os.path.exists(folder)

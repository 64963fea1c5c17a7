"""activator.process.watcher.FileWatcher: a change of the file's content is reported once.

Real files in ``tmp_path``; ``check`` is called directly (one poll), so nothing waits.
"""

from __future__ import annotations

import os
from pathlib import Path

from activator.process.watcher import FileWatcher


def watcher_of(path: Path) -> tuple[FileWatcher, list[str]]:
    calls: list[str] = []
    return FileWatcher(str(path), calls.append, interval=60.0), calls


def test_a_changed_file_is_reported_once(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text("services: {}\n")
    watcher, calls = watcher_of(path)
    assert not watcher.check()
    path.write_text("services: {}\nworkers: 1\n")
    assert watcher.check() and calls == ["file changed"]
    assert not watcher.check() and calls == ["file changed"]


def test_a_touch_without_new_content_is_not_a_change(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text("services: {}\n")
    watcher, calls = watcher_of(path)
    os.utime(path, ns=(1, 1))
    assert not watcher.check() and calls == []


def test_an_edit_read_by_a_sighup_reload_is_not_applied_again(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text("services: {}\n")
    watcher, calls = watcher_of(path)
    path.write_text("services: {}\nworkers: 1\n")
    watcher.mark_seen()  # what the SIGHUP reload does before it reads the file
    assert not watcher.check() and calls == []
    path.write_text("services: {}\nworkers: 2\n")  # a later edit still counts
    assert watcher.check() and calls == ["file changed"]

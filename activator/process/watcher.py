"""Watching the config file: a greenlet that polls ``os.stat`` and compares content.

Why polling: inotify-based watchers miss a Kubernetes-style ``..data`` symlink swap
and the ``watchdog`` package breaks under monkey-patching (reference/stack.md).
``os.stat`` follows symlinks, so an editor's atomic rename, an in-place write and a
symlink swap all change what it returns; a content hash catches a same-size rewrite
within one mtime tick. A missing file (mid-rename) keeps the current config.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable

import gevent

log = logging.getLogger("activator")

POLL_SECONDS = float(os.environ.get("ACTIVATOR_WATCH_INTERVAL", "1.0"))


def fingerprint(path: str) -> tuple[object, ...] | None:
    """What identifies a version of the file, or None when it cannot be read now."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            digest = hashlib.blake2b(f.read(), digest_size=16).digest()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, digest)


class FileWatcher:
    """Calls ``on_change(reason)`` when the file at ``path`` changes."""

    def __init__(self, path: str, on_change: Callable[[str], None], interval: float = POLL_SECONDS) -> None:
        self.path = path
        self.on_change = on_change
        self.interval = interval
        self._seen = fingerprint(path)

    def mark_seen(self) -> None:
        """The file is being read by someone else (a SIGHUP reload): this version is seen."""
        self._seen = fingerprint(self.path)

    def check(self) -> bool:
        """One poll; True (and the callback called) when the file changed."""
        current = fingerprint(self.path)
        if current is None or current == self._seen:
            return False
        changed_content = self._seen is None or current[-1] != self._seen[-1]
        self._seen = current
        if changed_content:
            self.on_change("file changed")
        return changed_content

    def run(self) -> None:
        while True:
            gevent.sleep(self.interval)
            try:
                self.check()
            except Exception:  # a reload bug must not kill the watcher
                log.exception("config watcher")

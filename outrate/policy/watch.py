"""Watching the policy's directories: when did something change, and has it gone quiet?

Separate from the reloader because it answers a different question. The
`Reloader` decides what an edit means (read, build, validate, swap); this
module only turns filesystem events into "check now", once a burst of them
is over. It knows nothing about policies, so its threads and watchdog's
quirks can be read (and reasoned about) on their own.

Why watch the parent directory and react to any event in it: rename-based
editors and ConfigMaps never write to the policy's own inode, they swap names
around it, so per-file watches go stale. The reloader's hash guard turns
unrelated events into no-ops.

watchdog is imported lazily (inside methods), so `outrate lint` and anything
else importing the core does not pay for it or need it installed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from outrate.errors import OutrateError

if TYPE_CHECKING:
    from watchdog.observers.api import BaseObserver

_IGNORED_EVENTS = frozenset({"opened", "closed_no_write"})
"""Our own reads of the file cause these; reacting to them would loop forever."""

MAX_WAIT_S = 0.5
"""A directory that never goes quiet (a trace or log written beside the policy)
must not postpone a reload forever: check at most this long after the first
event of a burst."""


class Watcher:
    """Calls `on_quiet` once events in the watched directories stop for `debounce_s`.

    Thread model: one observer thread (watchdog) only records that something
    happened (`poke`); one worker thread waits for quiet, then calls
    `on_quiet`, and once more if `rewatch` found a directory to add (an edit
    made there before it was watched). `on_quiet` runs in the worker only.

    The directories are the policy's, plus those of the files `deps()` names
    (the keys file), each with its symlink target's directory when that
    lives elsewhere.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        deps: Callable[[], tuple[str, ...]],
        on_quiet: Callable[[], object],
        *,
        native: bool,
        debounce_s: float,
        poll_interval_s: float,
        logger: logging.Logger,
    ) -> None:
        """`native`: try inotify (and friends) first; else poll from the start."""
        self.path = path
        self._deps = deps
        self._on_quiet = on_quiet
        self.native = native
        self.debounce_s = debounce_s
        self.poll_interval_s = poll_interval_s
        self.logger = logger
        self.kind: str | None = None
        """`native` or `polling` once started."""
        self.watches: dict[str, Any] = {}  # directory -> watchdog's ObservedWatch
        self._cond = threading.Condition()
        self._due: float | None = None
        self._first: float | None = None  # first event since the last check
        self._stopping = False
        self._observer: BaseObserver | None = None
        self._handler: _Handler | None = None
        self._worker: threading.Thread | None = None

    def start(self) -> None:
        """Start the worker, then the observer; a failing observer stops the worker."""
        with self._cond:
            self._stopping = False
            self._due = None
        self._worker = threading.Thread(target=self._run, name="outrate-reload", daemon=True)
        self._worker.start()
        try:
            self._observer = self._start_observer()
        except BaseException:
            self._stop_worker()
            raise

    def stop(self) -> None:
        """Stop the observer and join both threads. Safe from the worker itself."""
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            observer.join()
        self._stop_worker()

    def poke(self) -> None:
        """Something changed in a directory: (re)arm the debounce timer."""
        with self._cond:
            if not self._stopping:
                now = time.monotonic()
                if self._first is None:
                    self._first = now
                self._due = min(
                    now + self.debounce_s, self._first + max(MAX_WAIT_S, self.debounce_s)
                )
                self._cond.notify_all()

    def rewatch(self) -> bool:
        """Watch the directories the policy and the files it read live in now:
        a symlink retargeted to another directory (as often as it is), a keys
        file whose directory appeared. Stale directories are unwatched. True
        when one was added: the caller checks once more, for an edit made
        there before it was watched."""
        observer, handler = self._observer, self._handler
        if observer is None or handler is None:
            return False
        dirs = self._all_dirs()
        for d in [d for d in self.watches if d not in dirs]:
            observer.unschedule(self.watches.pop(d))
        added = False
        for d in dirs:
            if d in self.watches:
                continue
            try:
                self.watches[d] = self._watch(observer, handler, d)
                added = True
            except OSError as err:  # gone again, or out of inotify watches
                self.logger.warning("%s: cannot watch %s (%s)", self.path, d, err)
        return added

    # -- which directories ---------------------------------------------------

    def _watch_dirs(self, path: str | os.PathLike[str] | None = None) -> list[str]:
        """The file's directory, plus the symlink target's if it lives elsewhere
        (the policy's by default; each dependency's too).

        A target inside the directory (ConfigMap `..2026_xx/`) is not watched:
        those directories come and go, and the `..data` swap shows up in the
        parent anyway.
        """
        path = self.path if path is None else path
        link_dir = os.path.dirname(os.path.abspath(path))
        dirs = [link_dir]
        real_parent = os.path.realpath(link_dir)
        real_dir = os.path.dirname(os.path.realpath(path))
        if real_dir != real_parent and not real_dir.startswith(real_parent + os.sep):
            if os.path.isdir(real_dir):
                dirs.append(real_dir)
        return dirs

    def _dep_dirs(self) -> list[str]:
        """Existing directories of the dependencies, not already the policy's."""
        own = set(self._watch_dirs())
        out: list[str] = []
        for dep in self._deps():
            for d in self._watch_dirs(dep):
                if d not in own and d not in out and os.path.isdir(d):
                    out.append(d)
        return out

    def _all_dirs(self) -> list[str]:
        dirs = self._watch_dirs()
        return dirs + [d for d in self._dep_dirs() if d not in dirs]

    # -- the observer ----------------------------------------------------------

    def _watch(self, observer: BaseObserver, handler: _Handler, d: str) -> Any:
        return observer.schedule(handler, d, recursive=False, event_filter=self._events())  # type: ignore[arg-type]

    def _start_observer(self) -> BaseObserver:
        from watchdog.observers.polling import PollingObserver

        dirs = self._watch_dirs()
        if not os.path.isdir(dirs[0]):
            raise OutrateError(f"{self.path}: cannot watch {dirs[0]}: no such directory")
        if self.native:
            from watchdog.observers import Observer

            try:
                observer = self._schedule(Observer(), dirs)
                observer.start()
                self.kind = "native"
                return observer
            except OSError as err:
                # Typically the inotify instance or watch limit of this user.
                self.logger.warning(
                    "%s: native file watching unavailable (%s); polling every %gs instead",
                    self.path,
                    err,
                    self.poll_interval_s,
                )
        observer = self._schedule(PollingObserver(timeout=self.poll_interval_s), dirs)
        try:
            observer.start()
        except OSError as err:
            raise OutrateError(f"{self.path}: cannot watch {dirs[0]}: {err}") from err
        self.kind = "polling"
        return observer

    @staticmethod
    def _events() -> list[Any]:
        from watchdog import events as ev

        wanted = [
            ev.DirCreatedEvent, ev.DirDeletedEvent, ev.DirModifiedEvent, ev.DirMovedEvent,
            ev.FileClosedEvent, ev.FileCreatedEvent, ev.FileDeletedEvent,
            ev.FileModifiedEvent, ev.FileMovedEvent,
        ]  # fmt: skip
        # chmod can make an unreadable policy readable; attrib events are their
        # own classes only in newer watchdog versions.
        wanted += [getattr(ev, n) for n in ("FileAttribEvent", "DirAttribEvent") if hasattr(ev, n)]
        return wanted

    def _schedule(self, observer: BaseObserver, dirs: list[str]) -> BaseObserver:
        handler = self._handler = _Handler(self.poke)
        dirs = [*dirs, *(d for d in self._dep_dirs() if d not in dirs)]
        self.watches = {d: self._watch(observer, handler, d) for d in dirs}
        return observer

    # -- the worker --------------------------------------------------------------

    def _run(self) -> None:
        """Worker: wait until events stop for `debounce_s`, then check once."""
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    if self._due is None:
                        self._cond.wait()
                        continue
                    delay = self._due - time.monotonic()
                    if delay <= 0:
                        self._due = self._first = None
                        break
                    self._cond.wait(delay)
            try:
                self._on_quiet()
                if self.rewatch():
                    self._on_quiet()
            except Exception:  # never let the worker die: it is the only one
                self.logger.exception("%s: unexpected error while checking the policy", self.path)

    def _stop_worker(self) -> None:
        with self._cond:
            self._stopping = True
            self._due = None
            self._cond.notify_all()
        worker, self._worker = self._worker, None
        if worker is not None and worker is not threading.current_thread():
            worker.join()


class _Handler:
    """The observer's handler, duck-typed so watchdog stays a lazy import."""

    def __init__(self, poke: Callable[[], None]) -> None:
        self._poke = poke

    def dispatch(self, event: Any) -> None:
        if event.event_type not in _IGNORED_EVENTS:
            self._poke()

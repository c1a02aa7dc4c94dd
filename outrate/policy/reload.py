"""Hot reload of the policy file, envoy-style: build and validate, then swap.

An operator edits the policy while the engine serves. Whatever the edit looks
like on disk (in-place rewrite in several chunks, an editor's temp-file rename,
`sed -i`, a Kubernetes ConfigMap `..data` symlink swap, delete-then-recreate),
the `Reloader` ends up doing one thing: after the directory has gone quiet for
`debounce_s`, read the file's bytes and, if they differ from the bytes last
seen, load and compile the whole policy. Only a policy that compiled is handed
to `on_apply`; a bad edit is logged (with the same text `outrate lint` prints),
counted, and the last good policy keeps serving.

Which events, and when a burst of them is over, is the `Watcher`'s business
(`outrate.policy.watch`): it watches the policy's directory, not the file, and
calls back once the directory has gone quiet. Reading a small file and hashing
it is cheap; the hash guard here turns unrelated events into no-ops.

A policy can be built from more files than its own (`identity.keys`: the keys
file). Their directories are watched too, and the guard hashes every one of
them (`CompiledPolicy.fingerprint`), so adding or revoking a key reloads the
policy exactly like an edit of the policy itself, valid or not.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Literal

from outrate.errors import OutrateError, PolicyError
from outrate.policy.changes import brief, describe_changes
from outrate.policy.compiler import CompiledPolicy
from outrate.policy.file import read_policy_file
from outrate.policy.pipeline import load_compiled
from outrate.policy.watch import Watcher

Mode = Literal["watch", "poll", "off"]
Loader = Callable[[str | os.PathLike[str]], CompiledPolicy]
"""What turns the file into a policy; `load_compiled` (tests inject failures)."""

_MISSING = "<missing>"
"""Digest recorded while the file does not exist, so one deletion warns once."""


class Reloader:
    """Keeps `current` equal to the last policy file content that compiled.

    Thread model: the `Watcher`'s worker thread checks once the directories
    went quiet. Checks and `reload_now()` are serialized by one lock, so
    `on_apply` is never called concurrently and always in file-content order.

    Counters (`applied`, `rejected`, `checks`) only grow; `wait_applied()` and
    friends let callers block until the next one moves, without sleeping.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_apply: Callable[[CompiledPolicy], None],
        *,
        initial: CompiledPolicy | None = None,
        mode: Mode = "watch",
        debounce_s: float = 0.15,
        poll_interval_s: float = 0.5,
        logger: logging.Logger = logging.getLogger("outrate.reload"),  # noqa: B008
        loader: Loader | None = None,
        log: bool = True,
    ) -> None:
        """`log=False`: count edits without logging them (a second reloader of
        the same files, in the API server, beside the engine core's)."""
        if mode not in ("watch", "poll", "off"):
            raise OutrateError(f"reload mode must be watch, poll or off, got {mode!r}")
        if debounce_s < 0 or poll_interval_s <= 0:
            raise OutrateError("debounce_s must be >= 0 and poll_interval_s > 0")
        self.path = path
        self.mode: Mode = mode
        self.debounce_s = debounce_s
        self.poll_interval_s = poll_interval_s
        self.logger = logger
        self.log = log
        self._on_apply = on_apply
        self._loader: Loader = loader or load_compiled
        self._current = initial
        self.applied = 0
        self.rejected = 0
        self.checks = 0
        self.last_error: str | None = None
        # The engine loaded `initial` from this file: remember the digest of the
        # bytes it compiled, so the first unrelated event does not reload the
        # same policy, and an edit made since is caught by the first check.
        self._deps: tuple[str, ...] = initial.depends_on if initial is not None else ()
        """Files besides the policy that the last load read (the keys file)."""
        self._seen: str | None = None
        if initial is not None:
            self._seen = initial.fingerprint if initial.sha256 else self._fingerprint()
        self._cond = threading.Condition()  # counters and last_error
        self._load_lock = threading.Lock()
        self._state_lock = threading.RLock()
        self._running = False
        self._watcher = Watcher(
            path,
            lambda: self._deps,
            self._check,
            native=mode == "watch",
            debounce_s=debounce_s,
            poll_interval_s=poll_interval_s,
            logger=logger,
        )

    # -- public API ----------------------------------------------------------

    @property
    def current(self) -> CompiledPolicy | None:
        """The last policy that compiled and was applied (or `initial`)."""
        return self._current

    @property
    def observer_kind(self) -> str | None:
        """`native` or `polling` once started in a watching mode."""
        return self._watcher.kind

    @property
    def _watches(self) -> dict[str, Any]:
        """Directory -> watchdog's watch, for the directories watched now."""
        return self._watcher.watches

    def start(self) -> None:
        """Load the policy if none was given, then watch for edits (idempotent).

        Loading here rather than on the first event means a missing or bad file
        at startup is visible at once in `last_error`. The catch-up check after
        the observer started covers edits made before it was watching.
        """
        with self._state_lock:
            if self._running:
                return
            self._running = True
            if self._current is None:
                self.reload_now()
            if self.mode == "off":
                return
            try:
                self._watcher.start()
            except BaseException:
                self._running = False
                raise
            self._check()
            if self._watcher.rewatch():
                self._check()

    def stop(self) -> None:
        """Stop watching and join the threads (idempotent). Safe from `on_apply`."""
        with self._state_lock:
            if not self._running:
                return
            self._running = False
        self._watcher.stop()

    def reload_now(self) -> bool:
        """Load, validate and apply the file synchronously; True if applied.

        Unlike an event-driven check this loads even when the bytes did not
        change: it is the explicit "apply what is on disk" verb (SIGHUP, tests).
        """
        with self._load_lock:
            self._seen = self._fingerprint()
            return self._load_and_apply()

    def wait_for(self, predicate: Callable[[Reloader], bool], timeout: float = 5.0) -> bool:
        """Block until `predicate(self)` holds (re-checked on every counter change)."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)

    def wait_applied(self, n: int, timeout: float = 5.0) -> bool:
        """Block until at least `n` policies were applied in total."""
        return self.wait_for(lambda r: r.applied >= n, timeout)

    def wait_rejected(self, n: int, timeout: float = 5.0) -> bool:
        """Block until at least `n` edits were rejected in total."""
        return self.wait_for(lambda r: r.rejected >= n, timeout)

    def wait_checked(self, n: int, timeout: float = 5.0) -> bool:
        """Block until the file was looked at `n` times (applied, rejected or unchanged)."""
        return self.wait_for(lambda r: r.checks >= n, timeout)

    # -- checking and applying -----------------------------------------------

    def _digest(self, path: str | os.PathLike[str] | None = None) -> str:
        """sha256 of the bytes now behind the path (symlinks followed), read by
        the loader's own bounded read: what `CompiledPolicy.sha256` holds."""
        try:
            return hashlib.sha256(read_policy_file(path or self.path)).hexdigest()
        except PolicyError as err:
            if isinstance(err.__cause__, FileNotFoundError):
                return _MISSING
            # Unreadable (permissions, a FIFO, too big...): let the loader say
            # why, once per distinct failure.
            return f"<error {err}>"

    def _fingerprint(self) -> str:
        """The policy's digest, then each dependency's: `CompiledPolicy.fingerprint`."""
        return self._digest() + "".join(f"+{self._digest(dep)}" for dep in self._deps)

    def _check(self) -> bool:
        """Apply the file if its bytes (or a dependency's) changed since last
        seen; True if applied."""
        with self._load_lock:
            try:
                fingerprint = self._fingerprint()
                if fingerprint == self._seen:
                    return False
                self._seen = fingerprint
                if fingerprint.partition("+")[0] == _MISSING:
                    self._reject(
                        f"{self.path}: policy file deleted; keeping the last good policy"
                        f" ({brief(self._current)})",
                        logging.WARNING,
                    )
                    return False
                return self._load_and_apply()
            finally:
                self._bump("checks")

    def _load_and_apply(self) -> bool:
        """Build the whole new policy, then hand it over. Caller holds `_load_lock`."""
        try:
            new = self._loader(self.path)
        except PolicyError as err:
            self._depend_on(err.depends_on)
            self._reject(str(err), logging.ERROR, "reload rejected, keeping the last good policy")
            return False
        except Exception as err:
            self.logger.exception("%s: reload failed, keeping the last good policy", self.path)
            self._reject(f"{self.path}: {type(err).__name__}: {err}", None)
            return False
        old = self._current
        try:
            self._on_apply(new)
        except Exception as err:
            self.logger.exception(
                "%s: applying the new policy failed; keeping the old one", self.path
            )
            self._reject(f"{self.path}: on_apply: {type(err).__name__}: {err}", None)
            return False
        self._current = new
        self._depend_on(new.depends_on, new.fingerprint if new.sha256 else None)
        if self.log:
            self.logger.info("%s: policy reloaded: %s", self.path, describe_changes(old, new))
        with self._cond:
            self.last_error = None
            self.applied += 1
            self._cond.notify_all()
        return True

    def _depend_on(self, deps: tuple[str, ...], loaded: str | None = None) -> None:
        """Remember the files the last load read, and watch them. `_seen` then
        covers them too: exactly what was loaded when it compiled (`loaded`),
        else their bytes now."""
        if loaded is not None:
            self._deps = deps
            self._seen = loaded
        elif deps != self._deps:
            self._deps = deps
            self._seen = self._fingerprint()
        if self._watcher.rewatch():
            self._watcher.poke()  # one more check, for an edit made before it was watched

    def _reject(self, message: str, level: int | None, header: str = "") -> None:
        """Count and remember a bad edit; log it unless the caller already did."""
        if level is not None and self.log:
            if header:
                self.logger.log(level, "%s: %s:\n%s", self.path, header, message)
            else:
                self.logger.log(level, "%s", message)
        with self._cond:
            self.last_error = message
            self.rejected += 1
            self._cond.notify_all()

    def _bump(self, counter: str) -> None:
        with self._cond:
            setattr(self, counter, getattr(self, counter) + 1)
            self._cond.notify_all()

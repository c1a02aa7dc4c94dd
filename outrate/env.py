"""Every environment variable outrate reads, in one frozen record (`Env`).

Most are written by outrate itself in one process and read in another: the
API server puts the store's password, the identity secret, its identity
settings and the metrics directory in the environment the engine core (or
another API server) inherits, because vLLM's config, which does travel, is
hashed and may be printed. The rest are for operators: the read limits of
policy, workload and trace files, and the CPU spin sleep. Values stay raw
strings here; each reader parses its own, so its error names the variable
and the value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

IDENTITY_SECRET = "OUTRATE_IDENTITY_SECRET"
"""Per start, made by the API server: the key it signs resolved identities with."""
STORE_PASSWORD = "OUTRATE_STORE_PASSWORD"
"""The budget store's password (from the URL, moved out of vLLM's config, or set by hand)."""
STORE_SSL_PASSWORD = "OUTRATE_STORE_SSL_PASSWORD"
"""The password of the store's TLS private key (`?ssl_password=` in a `rediss://` URL,
moved out of vLLM's config like the store's password, or set by hand)."""
API_SETTINGS = "OUTRATE_API_SETTINGS"
"""The identity settings for API servers started after the flags were parsed (JSON)."""
METRICS_DIR = "OUTRATE_METRICS_DIR"
"""`PID:DIR`: where engines write their metrics snapshots, and which process made DIR."""
MAX_POLICY_BYTES = "OUTRATE_MAX_POLICY_BYTES"
"""The read limit of policy and keys files (default 64 MiB)."""
MAX_WORKLOAD_BYTES = "OUTRATE_MAX_WORKLOAD_BYTES"
"""The read limit of `outrate simulate` workload files (default 64 MiB)."""
MAX_TRACE_BYTES = "OUTRATE_MAX_TRACE_BYTES"
"""The read limit of traces read back (`simulate calibrate --trace`; default 512 MiB)."""
SHM_SPIN_SLEEP_US = "OUTRATE_SHM_SPIN_SLEEP_US"
"""Sleep in vLLM's shared-memory busy wait (CPU machines); `outrate serve` sets 100 on CPU."""


@dataclass(frozen=True)
class Env:
    identity_secret: str = ""
    store_password: str = ""
    api_settings: str | None = None
    metrics_dir: str = ""
    max_policy_bytes: str = ""
    shm_spin_sleep_us: str | None = None
    store_ssl_password: str = ""
    max_workload_bytes: str = ""
    max_trace_bytes: str = ""

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Env:
        """The variables as they are now (in `environ`, default the process's)."""
        e = os.environ if environ is None else environ
        return cls(
            identity_secret=e.get(IDENTITY_SECRET, ""),
            store_password=e.get(STORE_PASSWORD, ""),
            store_ssl_password=e.get(STORE_SSL_PASSWORD, ""),
            api_settings=e.get(API_SETTINGS),
            metrics_dir=e.get(METRICS_DIR, ""),
            max_policy_bytes=e.get(MAX_POLICY_BYTES, ""),
            shm_spin_sleep_us=e.get(SHM_SPIN_SLEEP_US),
            max_workload_bytes=e.get(MAX_WORKLOAD_BYTES, ""),
            max_trace_bytes=e.get(MAX_TRACE_BYTES, ""),
        )

    def file_limit(self, name: str) -> str:
        """The raw value of the read-limit variable `name` (`OUTRATE_MAX_*_BYTES`)."""
        limits = {
            MAX_POLICY_BYTES: self.max_policy_bytes,
            MAX_WORKLOAD_BYTES: self.max_workload_bytes,
            MAX_TRACE_BYTES: self.max_trace_bytes,
        }
        return limits[name]

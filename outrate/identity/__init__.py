"""Who a request belongs to: the identity rules (`core`) and the API server's
per-request decision (`gate`). Imports nothing else of outrate."""

from outrate.identity.core import (
    ANONYMOUS,
    IDENTITY_KEY,
    IdentityConfig,
    KeyTable,
    Stamper,
    identity_error,
    resolve_identity,
)

__all__ = [
    "ANONYMOUS",
    "IDENTITY_KEY",
    "IdentityConfig",
    "KeyTable",
    "Stamper",
    "identity_error",
    "resolve_identity",
]

"""One error base class; every message says what and where."""

from __future__ import annotations

from typing import NamedTuple


class OutrateError(ValueError):
    """Base class of every error outrate raises on purpose."""


class Problem(NamedTuple):
    """One thing wrong with a policy, located in its file."""

    path: str
    line: int
    col: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.field}: {self.message}"


class PolicyError(OutrateError):
    """A policy file that cannot be used. Holds every problem found, in file order."""

    def __init__(
        self, problems: list[Problem] | tuple[Problem, ...], depends_on: tuple[str, ...] = ()
    ) -> None:
        self.problems: tuple[Problem, ...] = tuple(problems)
        self.depends_on = depends_on
        """Files besides the policy that the failed load read (the keys file), so
        a reloader watches them too and retries when one is fixed."""
        super().__init__("\n".join(str(p) for p in self.problems))

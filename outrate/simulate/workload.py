"""The workload file: who sends what, and when, to a simulated engine.

    version: 1
    duration: 60s            # simulated time
    seed: 7                  # same seed, same requests
    users:
      alice:                 # closed loop: 48 streams, each waits for its answer,
        streams: 48          # thinks, and asks again
        think: {exponential: 2s}
        prompt: {uniform: [200, 800]}
        output: 256
      bob:
        rate: 0.5            # open loop: 0.5 requests/s (poisson; or arrival: even)
        prompt: 300
        output: {lognormal: 200, sigma: 0.6, max: 1000}
        start: 10s
        stop: 50s
      team:
        count: 4             # a group: team-1 .. team-4, each with this load
        streams: 2
        prompt: 100
        output: 100

Read like a policy: the same YAML reader with positions and limits
(`outrate.policy.compose`), pydantic models that forbid unknown keys, and every
problem reported as `file:line:col: field: message`. `workload_json_schema()`
is the schema for editors (`outrate simulate schema`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    Field,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from outrate.env import MAX_WORKLOAD_BYTES
from outrate.errors import OutrateError, PolicyError, Problem
from outrate.fileread import FileLimit, FileReadError, decode_text, read_bounded
from outrate.identity.core import ANONYMOUS
from outrate.policy.compose import FAST_LOADER, Doc, Path, Pos, compose
from outrate.policy.loader import did_you_mean, field_path, type_message
from outrate.policy.values import check_user_id, check_version, problem, shown
from outrate.simulate.values import (
    RequestRate,
    Time,
    TimeDist,
    TokenDist,
    _Strict,
    parse_time,
    parse_whole,
)

WORKLOAD_FILE = FileLimit("a workload file", 64 * 1024 * 1024, MAX_WORKLOAD_BYTES)
MAX_STREAMS = 100_000
"""Closed-loop streams in one file: more is a typo (and hours of simulation)."""


class WorkloadError(OutrateError):
    """A workload file that cannot be used; every problem, in file order."""

    def __init__(self, problems: list[Problem] | tuple[Problem, ...]) -> None:
        self.problems: tuple[Problem, ...] = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


Whole = Annotated[
    int, PlainValidator(lambda v: parse_whole(v, 0)), WithJsonSchema({"type": "integer"})
]
Group = Annotated[
    int,
    PlainValidator(lambda v: parse_whole(v, 1)),
    WithJsonSchema({"type": "integer", "minimum": 1}),
]
Priority = Annotated[
    int,
    PlainValidator(lambda v: parse_whole(v, -(2**31))),
    WithJsonSchema({"type": "integer"}),
]


class UserLoad(_Strict):
    """One user's (or, with `count`, each of a group's) requests."""

    count: Group = Field(
        default=1,
        description="A group of users named <key>-1 .. <key>-<count>, each with this load.",
    )
    streams: Group | None = Field(
        default=None,
        description="Closed loop: this many concurrent streams; each sends its next "
        "request when the last one finished and the think time passed.",
    )
    rate: RequestRate | None = Field(
        default=None, description="Open loop: requests per second, whatever the engine does."
    )
    arrival: Literal["poisson", "even"] | None = Field(
        default=None, description="With rate: poisson (default) or evenly spaced arrivals."
    )
    think: TimeDist | None = Field(
        default=None, description="With streams: the pause between a stream's requests (0s)."
    )
    ramp: Time | None = Field(
        default=None, description="With streams: their first requests spread over this time."
    )
    prompt: TokenDist = Field(description="Prompt length in tokens.")
    prefix: Whole = Field(
        default=0, description="Leading prompt tokens every request of the user shares."
    )
    output: TokenDist = Field(description="Output length in tokens (ignore_eos).")
    start: Time = Field(default=0, description="When the user starts sending (default 0s).")
    stop: Time | None = Field(default=None, description="When it stops sending (default: the end).")
    priority: Priority = Field(default=0, description="Request priority (--scheduling-policy).")

    @model_validator(mode="after")
    def _one_loop(self) -> UserLoad:
        if self.streams is not None and self.rate is not None:
            raise problem("give 'streams' (closed loop) or 'rate' (open loop), not both")
        if self.streams is None and self.rate is None:
            raise problem(
                "needs either 'streams' (closed loop) or 'rate' (requests per second, open loop)"
            )
        if self.streams is None and (self.think is not None or self.ramp is not None):
            raise problem("'think' and 'ramp' go with 'streams', not with 'rate'")
        if self.rate is None and self.arrival is not None:
            raise problem("'arrival' goes with 'rate', not with 'streams'")
        if self.stop is not None and self.stop <= self.start:
            raise problem("'stop' must come after 'start'")
        return self

    @property
    def open_loop(self) -> bool:
        return self.rate is not None


def _check_duration(value: object) -> int:
    ns = parse_time(value)
    if ns <= 0:
        raise problem("must be > 0")
    return ns


Duration = Annotated[
    int,
    PlainValidator(_check_duration),
    WithJsonSchema({"type": "string", "description": "Simulated time, e.g. '60s'."}),
]


def _check_user(value: object) -> str:
    if value == ANONYMOUS:
        raise problem(
            f"'{ANONYMOUS}' is reserved for requests without identity, which a workload "
            "does not send; name the user"
        )
    return check_user_id(value)


WorkloadUser = Annotated[str, PlainValidator(_check_user), WithJsonSchema({"type": "string"})]
Version = Annotated[int, PlainValidator(check_version), WithJsonSchema({"const": 1})]


class Workload(_Strict):
    """Users and their load, for `outrate simulate`."""

    version: Version = Field(description="Always 1.")
    duration: Duration = Field(description="How long to simulate.")
    seed: Whole = Field(default=0, description="The random draws: same seed, same requests.")
    users: dict[WorkloadUser, UserLoad] = Field(description="User id -> its load.")

    @field_validator("users")
    @classmethod
    def _sane(cls, users: dict[str, UserLoad]) -> dict[str, UserLoad]:
        if not users:
            raise problem("name at least one user")
        streams = sum((u.streams or 0) * u.count for u in users.values())
        if streams > MAX_STREAMS:
            raise problem(f"at most {MAX_STREAMS} streams in all (got {streams})")
        return users

    def expanded(self) -> list[tuple[str, UserLoad]]:
        """(user id, load) per user, groups spelled out, in file order."""
        out: list[tuple[str, UserLoad]] = []
        for key, load in self.users.items():
            if load.count == 1:
                out.append((key, load))
            else:
                out += [(check_user_id(f"{key}-{i}"), load) for i in range(1, load.count + 1)]
        return out

    def longest_request(self) -> int | None:
        """Most tokens one request can hold (prompt + output), None if unbounded."""
        worst = 0
        for load in self.users.values():
            p, o = load.prompt.largest, load.output.largest
            if p is None or o is None:
                return None
            worst = max(worst, p + o)
        return worst


@dataclass(frozen=True)
class LoadedWorkload:
    """A validated workload and where it came from."""

    workload: Workload
    source: str


# -- reading, with file:line errors -------------------------------------------

_MISSING = {
    "version": "missing; a workload file starts with 'version: 1'",
    "duration": "missing; say how long to simulate (e.g. 'duration: 60s')",
    "users": "missing; list the users and their load under 'users:'",
    "prompt": "missing; the prompt length in tokens (a number or a distribution)",
    "output": "missing; the output length in tokens (a number or a distribution)",
}


def _message(err: Any) -> str:
    if err["type"] == "outrate":
        return str(err["msg"])
    if err["type"] == "too_long":
        return "must be a list of two values [low, high]"
    return type_message(err)


def _translate(err: ValidationError, doc: Doc) -> list[tuple[Path, Pos, str, str]]:
    out = []
    for e in err.errors():
        loc, kind = doc.real_path(tuple(e["loc"])), e["type"]
        if loc and loc[-1] == "[key]":
            where = loc[:-1]
            pos = doc.keypos.get(where) or doc.pos.get(doc.nearest(where), (1, 1))
            out.append((where, pos, field_path(loc[:-2]), _message(e)))
        elif kind == "extra_forbidden":
            pos = doc.keypos.get(loc) or doc.pos.get(doc.nearest(loc), (1, 1))
            unknown = f"unknown key {shown(loc[-1])}" + did_you_mean(Workload, loc[:-1], loc[-1])
            out.append((loc, pos, field_path(loc[:-1]), unknown))
        elif kind == "missing" and loc and isinstance(loc[-1], int):  # a short [low, high]
            where = doc.nearest(loc[:-1])
            pos = doc.pos.get(where, (1, 1))
            out.append((where, pos, field_path(where), "must be a list of two values [low, high]"))
        elif kind == "missing":
            parent = loc[:-1]
            pos = doc.pos.get(parent, (1, 1)) if parent else (1, 1)
            out.append((loc, pos, field_path(loc), _MISSING.get(str(loc[-1]), "missing")))
        else:
            where = doc.nearest(loc)
            pos = doc.pos.get(where, (1, 1)) if where else (1, 1)
            out.append((where, pos, field_path(where), _message(e)))
    return out


def parse_workload(text: str, source: str) -> Workload:
    """Parse and validate workload text; `source` names it in messages."""
    try:
        empty = yaml.compose(text, Loader=FAST_LOADER) is None
    except yaml.YAMLError:
        empty = False  # compose() below reports it, with the policy reader's words
    if empty:
        expected = "empty workload; expected a mapping with 'version: 1', 'duration' and 'users'"
        raise WorkloadError([Problem(source, 1, 1, "<root>", expected)])
    try:
        data, doc = compose(text, source)
    except PolicyError as e:
        raise WorkloadError(e.problems) from e
    found = [(path, pos, field_path(path), msg) for path, pos, msg in doc.problems]
    workload: Workload | None = None
    cause: ValidationError | None = None
    if not isinstance(data, dict):
        expected = "must be a mapping with 'version: 1', 'duration' and 'users'"
        found.append(((), (1, 1), "<root>", f"{expected} (got {shown(data)})"))
    else:
        try:
            workload = Workload.model_validate(data)
        except ValidationError as e:
            found += [item for item in _translate(e, doc) if not doc.is_voided(item[0])]
            cause = e
    if not found and workload is not None:
        return workload
    problems = sorted(
        {Problem(source, pos[0], pos[1], text, msg) for _, pos, text, msg in found},
        key=lambda p: (p.line, p.col, p.field, p.message),
    )
    raise WorkloadError(problems) from cause


def load_workload(path: str | os.PathLike[str]) -> LoadedWorkload:
    """Read and validate a workload file (every file's rules, `outrate.fileread`:
    a regular file, never blocking, at most `$OUTRATE_MAX_WORKLOAD_BYTES`).
    Every failure is a WorkloadError."""
    source = os.fspath(path)
    try:
        text = decode_text(read_bounded(source, WORKLOAD_FILE), source)
    except FileReadError as e:
        raise WorkloadError([e.problem]) from e.__cause__ or e
    return LoadedWorkload(parse_workload(text, source), source)


def workload_json_schema() -> dict[str, Any]:
    """The JSON Schema of workload files, for editors (yaml-language-server)."""
    schema = Workload.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "outrate simulate workload"
    return schema

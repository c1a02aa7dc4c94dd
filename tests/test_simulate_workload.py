"""The workload file of `outrate simulate`, driven by fixtures: one file per
kind of bad workload under tests/fixtures/simulate/bad/, each with its exact
messages (file:line:col included); the draws it makes; its JSON Schema."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from outrate.policy.pipeline import load_compiled
from outrate.simulate.plan import FIRST_TOKEN_ID, plan
from outrate.simulate.workload import (
    WorkloadError,
    load_workload,
    parse_workload,
    workload_json_schema,
)

REPO = Path(__file__).resolve().parent.parent
BAD = Path(__file__).parent / "fixtures" / "simulate" / "bad"
WORKLOADS = REPO / "examples" / "workloads"

EXPECTED = {
    "anonymous_user": [
        "FILE:4:3: users: '__anonymous__' is reserved for requests without identity, which a workload does not send; name the user",  # noqa: E501
    ],
    "arrival_unknown": [
        "FILE:6:14: users.a.arrival: input should be 'poisson' or 'even'",
    ],
    "arrival_with_streams": [
        "FILE:5:5: users.a: 'arrival' goes with 'rate', not with 'streams'",
    ],
    "both_loops": [
        "FILE:5:5: users.a: give 'streams' (closed loop) or 'rate' (open loop), not both",
    ],
    "count_zero": [
        "FILE:5:12: users.team.count: must be >= 1",
    ],
    "dist_none": [
        "FILE:6:13: users.a.prompt: needs exactly one of uniform, exponential, lognormal, choice",
    ],
    "dist_two_kinds": [
        "FILE:6:13: users.a.prompt: needs exactly one of uniform, exponential, lognormal, choice (got uniform, exponential)",  # noqa: E501
    ],
    "dist_unknown": [
        "FILE:6:14: users.a.prompt: unknown key 'normal' (did you mean 'lognormal'?)",
    ],
    "duplicate_user": [
        "FILE:5:3: users: duplicate key 'a' (first at line 4)",
    ],
    "duration_missing": [
        "FILE:1:1: duration: missing; say how long to simulate (e.g. 'duration: 60s')",
    ],
    "duration_no_unit": [
        "FILE:2:11: duration: must be a time like '500ms', '2s' or '5m', with a unit (got 60)",
    ],
    "duration_zero": [
        "FILE:2:11: duration: must be > 0",
    ],
    "empty": [
        "FILE:1:1: <root>: empty workload; expected a mapping with 'version: 1', 'duration' and 'users'",  # noqa: E501
    ],
    "invalid_yaml": [
        "FILE:5:1: <root>: invalid YAML: expected ',' or '}', but got '<stream end>' (while parsing a flow mapping at line 4)",  # noqa: E501
    ],
    "no_loop": [
        "FILE:5:5: users.a: needs either 'streams' (closed loop) or 'rate' (requests per second, open loop)",  # noqa: E501
    ],
    "not_mapping": [
        "FILE:1:1: <root>: must be a mapping with 'version: 1', 'duration' and 'users' (got a list)",  # noqa: E501
    ],
    "numeric_user": [
        "FILE:4:3: users: user id must be a string; quote it: '123'",
    ],
    "output_zero": [
        "FILE:7:13: users.a.output: must be >= 1",
    ],
    "prompt_missing": [
        "FILE:5:5: users.a.prompt: missing; the prompt length in tokens (a number or a distribution)",  # noqa: E501
    ],
    "prompt_not_whole": [
        "FILE:6:13: users.a.prompt: must be a whole number of tokens >= 1 (got 1.5)",
    ],
    "rate_zero": [
        "FILE:5:11: users.a.rate: must be a number of requests per second > 0 (got 0)",
    ],
    "sigma_alone": [
        "FILE:7:13: users.a.output: 'sigma' goes with 'lognormal'",
    ],
    "stop_before_start": [
        "FILE:5:5: users.a: 'stop' must come after 'start'",
    ],
    "streams_zero": [
        "FILE:5:14: users.a.streams: must be >= 1",
    ],
    "think_no_unit": [
        "FILE:6:26: users.a.think.exponential: must be a time like '500ms', '2s' or '5m', with a unit (got 2)",  # noqa: E501
    ],
    "think_with_rate": [
        "FILE:5:5: users.a: 'think' and 'ramp' go with 'streams', not with 'rate'",
    ],
    "too_many_streams": [
        "FILE:4:3: users: at most 100000 streams in all (got 101000)",
    ],
    "uniform_reversed": [
        "FILE:6:13: users.a.prompt: uniform: the low end must not exceed the high end",
    ],
    "uniform_short": [
        "FILE:6:23: users.a.prompt.uniform: must be a list of two values [low, high]",
    ],
    "unknown_key": [
        "FILE:8:5: users.a: unknown key 'thinks' (did you mean 'think'?)",
    ],
    "unknown_root_key": [
        "FILE:2:1: <root>: unknown key 'duraton' (did you mean 'duration'?)",
    ],
    "user_not_mapping": [
        "FILE:4:6: users.a: must be a mapping (got 5)",
    ],
    "users_empty": [
        "FILE:3:8: users: name at least one user",
    ],
    "users_missing": [
        "FILE:1:1: users: missing; list the users and their load under 'users:'",
    ],
    "version_missing": [
        "FILE:1:1: version: missing; a workload file starts with 'version: 1'",
    ],
    "version_wrong": [
        "FILE:1:10: version: unsupported version 2; this outrate reads version 1",
    ],
}


def test_every_fixture_has_its_messages():
    assert sorted(p.stem for p in BAD.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_workload_messages(name):
    path = BAD / f"{name}.yaml"
    with pytest.raises(WorkloadError) as info:
        load_workload(path)
    expected = [line.replace("FILE", str(path)) for line in EXPECTED[name]]
    assert [str(p) for p in info.value.problems] == expected
    assert str(info.value) == "\n".join(expected)


def test_an_unreadable_file_is_located(tmp_path):
    with pytest.raises(WorkloadError) as info:
        load_workload(tmp_path / "nope.yaml")
    assert str(info.value).startswith(f"{tmp_path / 'nope.yaml'}:1:1: <file>: cannot read:")


@pytest.mark.parametrize("path", sorted(WORKLOADS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_workload_and_policy_loads(path):
    if path.stem.endswith("-policy"):  # the policies the examples run under
        assert load_compiled(path).summary()
    else:
        assert load_workload(path).workload.expanded()


def test_groups_are_spelled_out_and_shorthands_read():
    w = parse_workload(
        "version: 1\nduration: 1m\nusers:\n"
        "  team: {count: 3, streams: 2, prompt: 10, output: {choice: [5, 7]}}\n"
        "  solo: {rate: 1.5, arrival: even, prompt: {uniform: [3, 4]}, output: 2, start: 500ms}\n",
        "w.yaml",
    )
    assert w.duration == 60_000_000_000
    assert [u for u, _ in w.expanded()] == ["team-1", "team-2", "team-3", "solo"]
    assert w.users["solo"].start == 500_000_000
    assert w.longest_request() == 10 + 7  # team: prompt 10, output up to 7


def test_distributions_draw_within_their_bounds():
    w = parse_workload(
        "version: 1\nduration: 10s\nusers:\n  a:\n    streams: 1\n"
        "    think: {exponential: 1s, max: 3s}\n"
        "    prompt: {lognormal: 100, sigma: 1, min: 20, max: 400}\n"
        "    output: {uniform: [5, 9]}\n",
        "w.yaml",
    )
    load = w.users["a"]
    rng = random.Random(3)
    prompts = [load.prompt.sample(rng) for _ in range(2000)]
    outputs = [load.output.sample(rng) for _ in range(2000)]
    thinks = [load.think.sample(rng) for _ in range(2000)]
    assert min(prompts) == 20 and max(prompts) == 400  # the clamps bind on a wide lognormal
    assert 80 < sorted(prompts)[1000] < 125  # the median stays near 100
    assert set(outputs) == {5, 6, 7, 8, 9}
    assert max(thinks) == 3_000_000_000 and 0.8e9 < sum(thinks) / len(thinks) < 1.0e9


def test_the_same_seed_draws_the_same_requests_and_users_do_not_disturb_each_other():
    text = (
        "version: 1\nduration: 20s\nseed: 5\nusers:\n"
        "  a: {streams: 2, prompt: {uniform: [10, 50]}, output: 8, think: {exponential: 1s}}\n"
        "  b: {rate: 3, prompt: 20, output: 4}\n"
    )
    one, two = plan(parse_workload(text, "w")), plan(parse_workload(text, "w"))
    assert [s.next_request() for s in one.streams] == [s.next_request() for s in two.streams]
    assert one.arrivals == two.arrivals
    assert 30 < len(one.arrivals) < 90  # about 3/s over 20 s
    more = plan(parse_workload(text + "  c: {rate: 5, prompt: 3, output: 3}\n", "w"))
    b_only = [(t, r) for t, r in more.arrivals if r.user == "b"]
    assert b_only == one.arrivals
    req = plan(parse_workload(text, "w")).streams[0].next_request()
    assert all(FIRST_TOKEN_ID <= t < FIRST_TOKEN_ID + 256 for t in req.prompt)


def test_a_shared_prefix_is_the_same_for_every_request_of_a_user():
    w = parse_workload(
        "version: 1\nduration: 5s\nusers:\n  a: {streams: 2, prefix: 32, prompt: 64, output: 1}\n",
        "w",
    )
    p = plan(w)
    r1, r2 = p.streams[0].next_request(), p.streams[1].next_request()
    assert r1.prompt[:32] == r2.prompt[:32] and r1.prompt[32:] != r2.prompt[32:]
    assert len(r1.prompt) == 64


def test_the_shipped_schema_is_the_models_and_names_every_field():
    schema = workload_json_schema()
    shipped = json.loads((WORKLOADS / "workload.schema.json").read_text())
    assert shipped == json.loads(json.dumps(schema, sort_keys=True))
    load = schema["$defs"]["UserLoad"]["properties"]
    assert {"streams", "rate", "think", "prompt", "output", "start", "stop"} <= set(load)
    assert schema["additionalProperties"] is False

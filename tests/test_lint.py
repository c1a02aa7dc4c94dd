"""Lint rules (policy and deployment) and the deployment reader they run on.

Every deployment rule is checked from both inputs vLLM takes: `vllm serve`
flags and a `--config` YAML file (tests/fixtures/deploy/), with its location.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outrate.budget.limiter import Limit
from outrate.check.deployment import (
    Deployment,
    DeploymentError,
    deployment_from_args,
    deployment_from_config,
    load_deployment,
)
from outrate.check.lint import lint_all, lint_policy
from outrate.check.rules import REJECTED_MODEL_KINDS, Finding, lint_deployment
from outrate.errors import OutrateError
from outrate.policy.compiler import CompiledPolicy, compile_policy
from outrate.policy.loader import parse_policy
from outrate.policy.model import MAX_PATTERNS
from outrate.policy.pipeline import load_compiled, policy_from_flags

DEPLOY = Path(__file__).parent / "fixtures" / "deploy"
POLICIES = Path(__file__).parent.parent / "policies"
CAPPED = ["--max-num-seqs", "64", "--max-num-active-seqs", "48"]  # silences OR111


def codes(findings: list[Finding]) -> list[str]:
    return [f.code for f in findings]


# -- deployment rules: (code, config fixture, config line, argv variants) --------

RULES = [
    (
        "OR101",
        "speculative.yaml",
        3,
        [
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
            ["-sc", '{"method": "ngram"}'],
            ["--spec-model", "/models/draft"],
            ["--speculative-config.method", "ngram"],
        ],
    ),
    (
        "OR102",
        "data_parallel.yaml",
        2,
        [["-dp", "2"], ["--data-parallel-size=4"], ["--data_parallel_size", "2"]],
    ),  # noqa: E501
    ("OR103", "pipeline_parallel.yaml", 2, [["-pp", "2"], ["--pipeline-parallel-size", "2"]]),
    (
        "OR104",
        "kv_connector.yaml",
        2,
        [
            ["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'],
            [
                "--kv-transfer-config.kv_connector",
                "NixlConnector",
                "--kv-transfer-config.kv_role=kv_both",
            ],  # noqa: E501
        ],
    ),
    ("OR105", "ec_connector.yaml", 2, [["--ec-transfer-config", '{"ec_connector": "X"}']]),
    ("OR106", "kv_offload.yaml", 2, [["--kv-offloading-size", "16"], ["--kv_offloading_size=0.5"]]),
    (
        "OR107",
        "aux_output.yaml",
        2,
        [
            ["--enable-return-routed-experts"],
            ["--aux-output-config", '{"enable_return_routed_experts": true}'],
        ],
    ),
    ("OR108", "scheduler.yaml", 2, [["--scheduler-cls", "my_company.sched.FancyScheduler"]]),
    (
        "OR109",
        "diffusion.yaml",
        2,
        [["-dc", '{"canvas_length": 32}'], ["--diffusion-config", "{}"]],
    ),
    (
        "OR112",
        "no_chunked_prefill.yaml",
        2,
        [["--no-enable-chunked-prefill"], ["--no_enable_chunked_prefill"]],
    ),  # noqa: E501
]


@pytest.mark.parametrize(("code", "fixture", "line", "argvs"), RULES)
def test_rule_from_config_file(code: str, fixture: str, line: int, argvs: object) -> None:
    path = DEPLOY / fixture
    findings = lint_deployment(deployment_from_config(path))
    assert codes(findings) == [code]
    assert findings[0].location == f"{path}:{line}:1"


@pytest.mark.parametrize(("code", "fixture", "line", "argvs"), RULES)
def test_rule_from_command_line(code: str, fixture: str, line: int, argvs: list[list[str]]) -> None:
    for argv in argvs:
        findings = lint_deployment(deployment_from_args(["serve", "/models/tiny", *CAPPED, *argv]))
        assert codes(findings) == [code], argv
        assert findings[0].location == argv[0].partition("=")[0]


def test_data_parallel_is_fine_with_a_store() -> None:
    dep = deployment_from_args(["-dp", "2", "--outrate-store", "redis://:pw@h:6379/0"])
    assert dep.store and dep.data_parallel_size == 2
    assert "OR102" not in {f.code for f in lint_deployment(dep)}
    assert "OR102" in {f.code for f in lint_deployment(deployment_from_args(["-dp", "2"]))}
    full = deployment_from_args(
        ["-dp", "2", "--outrate-store", "redis://h/0", "--outrate-store-fallback", "full"]
    )
    (or115,) = [f for f in lint_deployment(full) if f.code == "OR115"]
    assert or115.severity == "warning" and or115.location == "--outrate-store-fallback"
    assert "up to N times its rate" in or115.message
    # The default fallback (local) at a cold start: N = 1 unless told.
    store = ["--outrate-store", "redis://h/0"]
    (or116,) = [f for f in lint_deployment(deployment_from_args(store)) if f.code == "OR116"]
    assert or116.location == "--outrate-store"
    assert "Pass --outrate-store-engines K" in or116.message
    for told in (
        ["--outrate-store-engines", "3"],
        ["-dp", "2"],
        ["--outrate-store-fallback", "pause"],
    ):
        assert "OR116" not in {f.code for f in lint_deployment(deployment_from_args(store + told))}
    old = deployment_from_args([*store, "--outrate-store-fallback", "share"])
    (or117,) = [f for f in lint_deployment(old) if f.code == "OR117"]
    assert "old name of 'pause'" in or117.message and "OR116" not in str(lint_deployment(old))
    with pytest.raises(DeploymentError, match="must be one of local, pause, full, got 'nope'"):
        deployment_from_args([*store, "--outrate-store-fallback", "nope"])
    assert deployment_from_args([*store, "--outrate-store-hold-s", "7.5"]).store_hold_s == 7.5
    # The store URL (and its password) never appears in a finding.
    assert all("pw" not in str(f) for f in lint_deployment(dep))
    with pytest.raises(DeploymentError, match="^--outrate-store must be a redis://") as exc:
        deployment_from_args(["--outrate-store", "http://:pw@h:6379"])
    assert "pw" not in str(exc.value)


def test_severities_and_reasons() -> None:
    findings = {
        f.code: f
        for f in lint_deployment(
            Deployment(
                speculative=True,
                data_parallel_size=2,
                pipeline_parallel_size=3,
                kv_connector="NixlConnector",
                ec_connector="ECExampleConnector",
                kv_offload=True,
                aux_output=True,
                scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler",
                model_kind="multimodal",
                chunked_prefill=False,
            )
        )
    }
    errors = {"OR101", "OR102", "OR103", "OR104", "OR105", "OR106", "OR107", "OR108", "OR109"}
    assert {c for c, f in findings.items() if f.severity == "error"} == errors
    assert {c for c, f in findings.items() if f.severity == "warning"} == {"OR111", "OR112"}
    assert findings["OR101"].message == (
        "speculative decoding is not supported: draft tokens are sampled without passing "
        "the per-user limiter"
    )
    assert "a user would get up to 2 times its rate" in findings["OR102"].message
    assert "pass --outrate-store redis://HOST:PORT/DB" in findings["OR102"].message
    assert "pipeline parallel size 3 is not supported" in findings["OR103"].message
    assert "KV connector 'NixlConnector' is not supported" in findings["OR104"].message
    assert "scheduler class 'vllm.v1.core.sched.scheduler.Scheduler'" in findings["OR108"].message
    assert findings["OR109"].message.startswith("multimodal models are not supported: ")
    assert all(f.location == "defaults" for f in findings.values())


@pytest.mark.parametrize("kind", sorted(REJECTED_MODEL_KINDS))
def test_rejected_model_kinds(kind: str) -> None:
    (finding,) = lint_deployment(Deployment(model_kind=kind, max_num_active_seqs=8))
    assert finding.code == "OR109" and finding.severity == "error"
    assert finding.message.startswith(f"{kind} models are not supported: ")


def test_fine_deployments() -> None:
    assert lint_deployment(deployment_from_config(DEPLOY / "good.yaml")) == []
    assert lint_deployment(Deployment(max_num_active_seqs=8, model_kind="decoder")) == []
    for ours in (
        "vllm_integration.enginecore.outrate_scheduler",
        "vllm_integration.step.scheduler.OutrateAsyncScheduler",
        "outrate_plugin.Sched",
    ):
        assert lint_deployment(Deployment(max_num_active_seqs=8, scheduler_cls=ours)) == []
    # tensor parallel and async scheduling are supported; speculative null is off
    argv = [*CAPPED, "-tp", "8", "--async-scheduling", "--speculative-config", "null"]
    assert lint_deployment(deployment_from_args(argv)) == []


def test_offload_connector_is_reported_once() -> None:
    """When the engine builds the Deployment from VllmConfig, offloading also shows
    up as the connector vLLM installed for it; one error is enough."""
    dep = Deployment(kv_offload=True, kv_connector="OffloadingConnector", max_num_active_seqs=8)
    assert codes(lint_deployment(dep)) == ["OR106"]


def test_active_seqs_unset() -> None:
    path = DEPLOY / "active_unset.yaml"
    (finding,) = lint_deployment(deployment_from_config(path))
    assert finding == Finding(
        "OR111",
        "warning",
        "--max-num-active-seqs is not set: throttled requests keep their running slot, so "
        "only a cap below --max-num-seqs leaves them room to yield their turn to "
        "unthrottled requests; set it below --max-num-seqs (64) (e.g. 48)",
        str(path),
    )
    (finding,) = lint_deployment(deployment_from_args([]))
    assert finding.location == "defaults"
    assert "set it below --max-num-seqs (the vLLM default)" in finding.message


def test_active_seqs_too_high() -> None:
    path = DEPLOY / "active_too_high.yaml"
    (finding,) = lint_deployment(deployment_from_config(path))
    assert finding.code == "OR111" and finding.location == f"{path}:2:1"
    assert finding.message.startswith("--max-num-active-seqs 64 is not below --max-num-seqs 64: ")
    argv = ["--max-num-seqs", "64", "--max-num-active-seqs", "80"]
    (finding,) = lint_deployment(deployment_from_args(argv))
    assert finding.location == "--max-num-active-seqs"
    # below the cap, or unknown cap (vLLM's default depends on the hardware): fine
    assert lint_deployment(deployment_from_args(["--max-num-active-seqs", "80"])) == []


# -- the deployment reader ---------------------------------------------------------


def test_defaults_match_vllm() -> None:
    dep = deployment_from_args(["serve", "/models/tiny"])
    assert dep == Deployment(source="command line")
    assert (dep.data_parallel_size, dep.pipeline_parallel_size, dep.tensor_parallel_size) == (
        1,
        1,
        1,
    )
    assert dep.chunked_prefill is None and dep.max_num_seqs is None and not dep.speculative


def test_flag_spellings() -> None:
    dep = deployment_from_args(
        [
            "serve",
            "--model",
            "m",
            "--unknown-flag",
            "value",
            "-tp=4",
            "--max_num_seqs=32",
            "--max-num-active-seqs",
            "24",
            "--enable-chunked-prefill",
            "--no-async-scheduling",
            "--scheduler_cls",
            "vllm_integration.enginecore.outrate_scheduler",
            "-q",
            "awq",
        ]
    )
    assert dep.tensor_parallel_size == 4
    assert (dep.max_num_seqs, dep.max_num_active_seqs) == (32, 24)
    assert dep.chunked_prefill is True and dep.async_scheduling is False
    assert dep.scheduler_cls == "vllm_integration.enginecore.outrate_scheduler"
    assert dep.locations["tensor_parallel_size"] == "-tp"
    assert dep.locations["max_num_seqs"] == "--max_num_seqs"
    assert dep.where("speculative") == "command line"


def test_config_then_command_line_overrides() -> None:
    config = DEPLOY / "good.yaml"
    dep = load_deployment(config, ["--max-num-active-seqs", "70", "--no-enable-chunked-prefill"])
    assert dep.tensor_parallel_size == 2 and dep.max_num_seqs == 64
    assert dep.max_num_active_seqs == 70 and dep.chunked_prefill is False
    assert dep.locations["max_num_seqs"] == f"{config}:5:1"
    assert dep.locations["max_num_active_seqs"] == "--max-num-active-seqs"
    # vLLM's own --config among the serve args works the same way
    same = deployment_from_args(
        [
            "serve",
            "--config",
            str(config),
            "--max-num-active-seqs=70",
            "--no-enable-chunked-prefill",
        ]
    )
    assert same == dep
    assert load_deployment(config) == deployment_from_config(config)


def test_config_file_spellings(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(
        "max_num_seqs: 16\n"
        "no-enable-chunked-prefill: true\n"
        'kv-transfer-config: \'{"kv_connector": "LMCacheConnectorV1"}\'\n'
        "unknown: 3\n"
    )
    dep = deployment_from_config(path)
    assert dep.max_num_seqs == 16 and dep.chunked_prefill is False
    assert dep.kv_connector == "LMCacheConnectorV1"
    assert dep.source == str(path) and dep.locations["kv_connector"] == f"{path}:3:1"
    path.write_text("")
    assert deployment_from_config(path) == Deployment(source=str(path))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-num-seqs", "lots"], "--max-num-seqs: expected an integer (got 'lots')"),
        (["--max-num-seqs"], "--max-num-seqs: expects a value"),
        (["-tp"], "-tp: expects a value"),
        (
            ["--kv-transfer-config", "{bad"],
            "--kv-transfer-config: invalid JSON (Expecting property name enclosed in double "
            "quotes)",
        ),
        (
            ["--kv-transfer-config", "[1]"],
            "--kv-transfer-config: expected a JSON object (got '[1]')",
        ),
        (
            ["--enable-chunked-prefill=false"],
            "--enable-chunked-prefill: takes no value; use --enable-chunked-prefill or "
            "--no-enable-chunked-prefill",
        ),
        (
            ["--kv-offloading-size", "big"],
            "--kv-offloading-size: expected a size in GiB (got 'big')",
        ),
        (["--config"], "--config: expects a value"),
    ],
)
def test_bad_command_line(argv: list[str], message: str) -> None:
    with pytest.raises(DeploymentError) as info:
        deployment_from_args(argv)
    assert str(info.value) == message
    assert isinstance(info.value, OutrateError)


def test_bad_config_files(tmp_path: Path) -> None:
    bad = DEPLOY / "bad_value.yaml"
    with pytest.raises(DeploymentError, match="^") as info:
        deployment_from_config(bad)
    assert str(info.value) == f"{bad}:1:1: max-num-seqs: expected an integer (got 'lots')"
    with pytest.raises(DeploymentError) as info:
        deployment_from_config(DEPLOY / "not_mapping.yaml")
    assert str(info.value).endswith(":1:1: a vLLM config file must be a mapping of flag names")
    missing = tmp_path / "none.yaml"
    with pytest.raises(DeploymentError) as info:
        deployment_from_config(missing)
    assert str(info.value) == f"{missing}:1:1: <file>: cannot read: No such file or directory"
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1\n")
    with pytest.raises(DeploymentError, match=r"broken.yaml:2:1: <root>: invalid YAML: "):
        deployment_from_config(broken)
    flag = tmp_path / "flag.yaml"
    flag.write_text("max-num-seqs: 4\nenable-chunked-prefill: sometimes\n")
    with pytest.raises(DeploymentError) as info:
        deployment_from_config(flag)
    assert str(info.value) == f"{flag}:2:1: enable-chunked-prefill: expected true or false"


# -- policy rules ------------------------------------------------------------------


def lint_text(text: str, prompts: bool = False) -> list[Finding]:
    """The policy's findings. OR011 (output capped, prompts unlimited: nearly
    every small policy here) only with `prompts`: it has tests of its own."""
    found = lint_policy(compile_policy(parse_policy(text, "p.yaml"), "p.yaml"))
    return found if prompts else [f for f in found if f.code != "OR011"]


def test_short_burst() -> None:
    findings = lint_text(
        "version: 1\ndefault: 5\nburst: 20ms\n"
        "users: {a: {rate: 5, burst: 10ms}, b: {rate: unlimited, burst: 1ms}}\n"
    )
    assert findings == [
        Finding(
            "OR001",
            "warning",
            "burst 20ms is shorter than an engine step on most GPUs (50 ms or more under "
            "load): budget that accrues between two steps beyond the burst is lost, so users "
            "get less than their rate",
            "p.yaml:3:8",
        ),
        Finding("OR001", "warning", findings[1].message, "p.yaml:4:29"),
    ]
    assert findings[1].message.startswith("burst 10ms is shorter")
    assert lint_text("version: 1\ndefault: 5\nburst: 50ms\n") == []


def test_short_burst_on_a_hand_built_policy() -> None:
    fast = Limit(5, 1_000_000, rule="users.x")
    c = CompiledPolicy(
        "built",
        Limit(5, 10**8, rule="default"),
        Limit(5, 10**8, rule="anon"),
        10**8,
        users={"x": fast},
    )  # noqa: E501
    (finding,) = [f for f in lint_policy(c) if f.code != "OR011"]  # OR011: its own tests
    assert finding.code == "OR001" and finding.location == "built"
    assert finding.message.startswith("users.x: burst 1ms is shorter")


def test_unused_tier() -> None:
    findings = lint_text(
        "version: 1\ndefault: {tier: free}\ntiers:\n  free: 5\n  gold: 50\n  pro: 9\n"
        "users: {a: {tier: pro}}\n"
    )
    assert findings == [
        Finding(
            "OR002",
            "warning",
            "tier 'gold' is defined but nothing refers to it (no user, match entry, default "
            "or anonymous), so its limit applies to nobody",
            "p.yaml:5:9",
        )
    ]


def test_shadowed_patterns() -> None:
    findings = lint_text(
        "version: 1\ndefault: 5\nmatch:\n"
        "  - {pattern: 'team-*', rate: 1}\n"
        "  - {pattern: 'team-*', rate: 2}\n"
        "  - {pattern: 'team-x', rate: 3}\n"
        "  - {pattern: 'trial-?', rate: 4}\n"
        "  - {pattern: '*', rate: 5}\n"
        "  - {pattern: 'late-*', rate: 6}\n"
    )
    assert [(f.code, f.location) for f in findings] == [
        ("OR003", "p.yaml:5:15"),
        ("OR003", "p.yaml:6:15"),
        ("OR003", "p.yaml:9:15"),
    ]
    assert findings[0].message == (
        "pattern 'team-*' can never match: match[0] 'team-*' comes first and matches every "
        "id it would (first match wins)"
    )
    assert "match[4] '*'" in findings[2].message


def _pairwise_findings(patterns: list[str]) -> list[tuple[str, int, int | None]]:
    """OR003/OR004 by their definition: each pattern against every earlier one."""
    out: list[tuple[str, int, int | None]] = []
    for j, later in enumerate(patterns):
        literal = not any(c in later for c in "*?[")
        for i, earlier in enumerate(patterns[:j]):
            if (
                earlier == later
                or set(earlier) == {"*"}
                or (literal and fnmatchcase(later, earlier))
            ):
                out.append(("OR003", j, i))
                break
        else:
            if literal:
                out.append(("OR004", j, None))
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(["a*", "a?", "*", "**", "ab", "a[bc]", "b*", "ac", "abc", "*c"]),
        min_size=1,
        max_size=12,
    )
)
def test_pattern_findings_agree_with_the_pairwise_definition(patterns: list[str]) -> None:
    text = "version: 1\ndefault: 5\nmatch:\n" + "".join(
        f"  - {{pattern: '{p}', rate: 1}}\n" for p in patterns
    )
    found = []
    for f in lint_text(text):
        j = int(f.location.split(":")[1]) - 4
        shadow = re.search(r"match\[(\d+)\]", f.message)
        found.append((f.code, j, int(shadow.group(1)) if shadow else None))
    assert found == _pairwise_findings(patterns)


def test_a_thousand_patterns_lint_in_linear_passes() -> None:
    """At the cap (MAX_PATTERNS), half of them shadowed: one pass, not pairs of pairs."""
    n = MAX_PATTERNS // 2
    text = (
        "version: 1\ndefault: 5\nmatch:\n"
        + "".join(f"  - {{pattern: 'team-{i}/*', rate: 1}}\n" for i in range(n))
        + "".join(f"  - {{pattern: 'team-{i}/x', rate: 1}}\n" for i in range(n))
    )
    findings = lint_text(text)
    assert [f.code for f in findings] == ["OR003"] * n
    assert f"match[{n - 1}] 'team-{n - 1}/*'" in findings[-1].message


def test_more_patterns_than_the_cap_is_a_located_error() -> None:
    text = "version: 1\ndefault: 5\nmatch:\n" + "".join(
        f"  - {{pattern: 't{i}-*', rate: 1}}\n" for i in range(MAX_PATTERNS + 1)
    )
    with pytest.raises(OutrateError) as e:
        parse_policy(text, "p.yaml")
    assert str(e.value) == (
        f"p.yaml:4:3: match: at most {MAX_PATTERNS} patterns (got {MAX_PATTERNS + 1}): list "
        "individual users under 'users:' (a tier gives many of them one limit)"
    )


def test_pattern_without_wildcard() -> None:
    (finding,) = lint_text("version: 1\ndefault: 5\nmatch:\n  - {pattern: bob, rate: 1}\n")
    assert finding == Finding(
        "OR004",
        "warning",
        "pattern 'bob' has no wildcard (*, ?, [...]) so it matches one user id only; list "
        "that user under 'users' instead",
        "p.yaml:4:15",
    )


def test_a_user_id_that_is_a_rule_label() -> None:
    findings = lint_text(
        "version: 1\ndefault: 5\nusers:\n  default: 1\n  'tier:gold': 2\n  bob: 3\n"
    )
    assert [(f.code, f.location) for f in findings] == [
        ("OR008", "p.yaml:4:12"),
        ("OR008", "p.yaml:5:16"),
    ]
    assert findings[0].message == (
        "user id 'default' is also the metrics label of a rule (default, anonymous, "
        "other, tier:NAME or match:PATTERN): its series and the rule's add up in one; "
        "rename the user"
    )


def test_anonymous_unlimited() -> None:
    (finding,) = lint_text("version: 1\ndefault: 5\nanonymous: unlimited\n")
    assert finding.code == "OR005" and finding.location == "p.yaml:3:12"
    assert "a client escapes its limit by sending no user id" in finding.message
    (finding,) = lint_text("version: 1\ndefault: unlimited\nusers: {a: 5}\n")
    assert finding.location == "p.yaml:2:10"
    assert "'anonymous' is not set and the default is unlimited" in finding.message
    assert lint_text("version: 1\ndefault: unlimited\n") == []
    # the flags limit output only: OR011 too
    assert codes(lint_policy(policy_from_flags(None, {"a": 5}))) == ["OR005", "OR011"]


def test_anonymous_borrowing_without_a_cap() -> None:
    """OR005 one level up: no user id, no cap on borrowing, while some
    identified user's borrowing is capped (a finite peak, or none)."""
    (finding,) = lint_text(
        "version: 1\ndefault: {rate: 5, peak: 50}\nanonymous: {rate: 5, peak: unlimited}\n"
    )
    assert finding == Finding(
        "OR010",
        "warning",
        "requests without a user id may borrow idle capacity without a cap ('anonymous' has "
        "peak: unlimited) while identified users' borrowing is capped: a client gets more by "
        "sending no user id; give 'anonymous' a finite peak",
        "p.yaml:3:28",
    )
    (finding,) = lint_text("version: 1\ndefault: {rate: 5, peak: unlimited}\nusers: {bob: 20}\n")
    assert finding.code == "OR010" and finding.location == "p.yaml:2:26"
    assert "('anonymous' is not set and the default has peak: unlimited)" in finding.message
    (finding,) = lint_text(
        "version: 1\ndefault: 5\nanonymous: {tier: t}\ntiers: {t: {rate: 1, peak: unlimited}}\n"
    )
    assert finding.location == "p.yaml:3:12"  # the peak is the tier's: at anonymous
    # every identified user may borrow as far, or is unlimited: nothing to escape
    uncapped = "{rate: 5, peak: unlimited}"
    assert lint_text(f"version: 1\ndefault: {uncapped}\n") == []
    both = f"anonymous: {uncapped}\nusers: {{a: {uncapped}}}\n"
    assert lint_text(f"version: 1\ndefault: unlimited\n{both}") == []
    assert lint_text("version: 1\ndefault: 5\nanonymous: {rate: 5, peak: 9}\n") == []
    shadow = "{rate: 5, peak: unlimited, shadow: true}"
    assert lint_text(f"version: 1\ndefault: 5\nanonymous: {shadow}\n") == []


OPEN_PROMPTS = (
    ": output capped, prompts unlimited: a user inside its output rate can fill every "
    "step with prefill; add prompt: RATE (size it with outrate simulate), or write "
    "prompt: unlimited where that is meant"
)


def test_output_capped_and_prompts_unlimited_is_one_warning() -> None:
    """OR011 names every rule with the hole, once: a user of a tier is its
    tier's; `prompt: unlimited` written, an unlimited rate and a shadow rule
    are no hole."""
    findings = lint_text(
        "version: 1\n"
        "default: 5\n"
        "anonymous: {rate: 5, prompt: 100}\n"
        "tiers:\n"
        "  free: 20\n"
        "  gold: {rate: 50, prompt: 1000}\n"
        "  open: unlimited\n"
        "users:\n"
        "  a: {tier: free}\n"
        "  b: {tier: gold, burst: 1s}\n"
        "  c: {rate: 5, prompt: unlimited}\n"
        "  d: {rate: 1, shadow: true}\n"
        "  e: {tier: open}\n"
        "match:\n"
        "  - pattern: 'x-*'\n"
        "    rate: 3\n",
        prompts=True,
    )
    assert findings == [
        Finding("OR011", "warning", "default, tiers.free, match[0]" + OPEN_PROMPTS, "p.yaml:2:10")
    ]
    assert lint_text("version: 1\ndefault: unlimited\nanonymous: unlimited\n", prompts=True) == []
    assert lint_text("version: 1\nmode: shadow\ndefault: 5\n", prompts=True) == []
    assert lint_text("version: 1\ndefault: {rate: 5, prompt: 50}\n", prompts=True) == []


def test_output_capped_and_prompts_unlimited_on_a_hand_built_policy() -> None:
    five = Limit(5, 10**8, rule="default")
    c = CompiledPolicy("built", five, Limit(5, 10**8, rule="anonymous"), 10**8)
    assert lint_policy(c) == [
        Finding("OR011", "warning", "default, anonymous" + OPEN_PROMPTS, "built")
    ]


PROMPT_POLICY = "version: 1\ndefault: {rate: 20, prompt: 500}\nusers:\n  u: 5\n"
QUIET = [*CAPPED, "--host", "::1"]  # silences OR111 and OR113


def test_a_store_with_prompt_limits_and_no_chunked_prefill_is_the_engines_error(
    tmp_path: Path,
) -> None:
    """OR119: a shared prompt budget is leased a slice at a time, so without
    chunked prefill a whole prompt would never fit; lint says what the engine
    says when it refuses to start or to reload (outrate/check/prompts.py).
    With chunked prefill (vLLM's default) prompt limits are shared."""
    path = tmp_path / "p.yaml"
    path.write_text(PROMPT_POLICY)
    store = ["--outrate-store", "redis://h:6379/0", "--outrate-store-engines", "2"]
    assert not lint_all(path, deployment_from_args([*QUIET, *store])).errors
    unchunked = [*QUIET, *store, "--no-enable-chunked-prefill", "--max-model-len", "51"]
    report = lint_all(path, deployment_from_args(unchunked))
    assert [(f.code, f.severity, f.location, f.message) for f in report.errors] == [
        (
            "OR119",
            "error",
            f"{path}:2:29",
            "default.prompt: with --outrate-store and chunked prefill off, a prompt limit "
            "cannot be kept: a prompt is then computed whole, but an engine holds a shared "
            "budget's credit one lease slice at a time (rate x lease horizon, "
            "docs/several-engines.md), so a prompt longer than the slice would wait "
            "forever; enable chunked prefill, or remove 'prompt' from: default, anonymous "
            "(default)",
        )
    ]
    assert codes(list(lint_all(path, deployment_from_args(QUIET)).findings)) == ["OR011"]
    assert lint_all(POLICIES / "demo.yaml", deployment_from_args([*QUIET, *store])).ok()


QUOTA_POLICY = "version: 1\ndefault: 20\nusers:\n  u: {rate: 5, quota: {output: 2M/day}}\n"


def test_a_quota_without_a_quota_file_or_beside_a_data_parallel_store_is_the_engines_error(
    tmp_path: Path,
) -> None:
    """OR121 and OR122: a quota is never silently ignored; lint says what
    both processes say when they refuse to start (outrate/check/quotas.py).
    A store with one engine per server shares the quota (it needs the file too)."""
    path = tmp_path / "p.yaml"
    path.write_text(QUOTA_POLICY)
    quota_file = ["--outrate-quota-file", str(tmp_path / "q.json")]
    store = ["--outrate-store", "redis://h:6379/0", "--outrate-store-engines", "2"]
    no_file = lint_all(path, deployment_from_args(QUIET))
    assert [(f.code, f.severity, f.location, f.message) for f in no_file.errors] == [
        (
            "OR121",
            "error",
            f"{path}:4:23",
            "users.u.quota: a quota needs --outrate-quota-file PATH: usage must survive a "
            "restart (a restart must not give anyone a fresh window)",
        )
    ]
    assert not lint_all(path, deployment_from_args([*QUIET, *quota_file, *store])).errors
    shared_no_file = lint_all(path, deployment_from_args([*QUIET, *store]))
    assert [f.code for f in shared_no_file.errors] == ["OR121"]
    dp = ["--data-parallel-size", "2"]
    shared = lint_all(path, deployment_from_args([*QUIET, *quota_file, *store, *dp]))
    assert [(f.code, f.location, f.message) for f in shared.errors] == [
        (
            "OR122",
            f"{path}:4:23",
            "users.u.quota: quotas with --outrate-store and --data-parallel-size above 1 are "
            "not built yet: the engine cores of one server would share one quota file (run "
            "one engine per server, or remove the quota)",
        )
    ]
    assert lint_all(path, deployment_from_args([*QUIET, *quota_file])).ok()
    assert lint_all(POLICIES / "demo.yaml", deployment_from_args(QUIET)).ok()


def test_without_chunked_prefill_a_prompt_burst_below_max_model_len_is_an_error(
    tmp_path: Path,
) -> None:
    """OR118: a whole prompt waits for a bucket that holds all of it. Lint
    knows max_model_len only from --max-model-len (the engine knows it
    always, and checks it at start and on reload)."""
    path = tmp_path / "p.yaml"
    path.write_text(PROMPT_POLICY)
    off = [*QUIET, "--no-enable-chunked-prefill"]
    report = lint_all(path, deployment_from_args([*off, "--max-model-len", "2048"]))
    assert [(f.code, f.location, f.message) for f in report.errors] == [
        (
            "OR118",
            f"{path}:2:29",
            "default.prompt: without chunked prefill a prompt is computed whole, so a prompt "
            "limit must hold the longest prompt (max_model_len 2048 tokens), but its burst "
            "holds 51 (rate x burst + 1): such prompts would wait forever; enable chunked "
            "prefill, or raise the prompt's rate or burst, in: default",
        )
    ]
    config = tmp_path / "serve.yaml"
    config.write_text(
        "host: 127.0.0.1\nmax-num-seqs: 8\nmax-num-active-seqs: 6\n"
        "enable-chunked-prefill: false\nmax-model-len: 4096\n"
    )
    assert codes(list(lint_all(path, deployment_from_config(config)).errors)) == ["OR118"]
    for fine in (
        [*off, "--max-model-len", "51"],  # the bucket holds the longest prompt
        [*off, "--max-model-len", "1k"],  # vLLM's spelling: unknown here, the engine checks
        off,  # the model's own: unknown here
        [*QUIET, "--max-model-len", "2048"],  # chunked prefill
    ):
        assert lint_all(path, deployment_from_args(fine)).errors == (), fine


def test_lookalike_user_ids() -> None:
    """Equal after NFKC and case folding: `Alice`, and a fullwidth `ｂｏｂ`."""
    text = (
        "version: 1\ndefault: 5\nusers:\n  alice: 1\n  Alice: 2\n"
        '  "\\uff42\\uff4f\\uff42": 3\n  bob: 4\n  carol: 5\n'
    )
    assert [(f.code, f.severity, f.location, f.message) for f in lint_text(text)] == [
        (
            "OR006",
            "warning",
            "p.yaml:5:10",
            "user id 'Alice' looks like 'alice' (p.yaml:4:10): they are equal after Unicode "
            "NFKC normalization and case folding, but are two users with two budgets",
        ),
        (
            "OR006",
            "warning",
            "p.yaml:7:8",
            "user id 'bob' looks like 'ｂｏｂ' (p.yaml:6:25): they are equal after Unicode "
            "NFKC normalization and case folding, but are two users with two budgets",
        ),
    ]


def test_user_ids_with_whitespace_at_an_end() -> None:
    """No request can carry `alice ` or `alice\u00a0` (400; a header loses its
    spaces), so their limits apply to nobody: a warning, since such policies
    loaded before and must keep loading."""
    text = 'version: 1\ndefault: 5\nusers:\n  "alice ": 1\n  "\\u00a0bob": 2\n  carol: 3\n'
    assert [(f.code, f.severity, f.location, f.message) for f in lint_text(text)] == [
        (
            "OR009",
            "warning",
            "p.yaml:4:13",
            "user id 'alice ' must not begin or end with whitespace (U+0020 at index 5): no "
            "request can carry it (a header loses its spaces and tabs, any other id with "
            "whitespace at an end is refused with 400), so this limit applies to nobody; "
            "remove the whitespace",
        ),
        (
            "OR009",
            "warning",
            "p.yaml:5:16",
            "user id '\\xa0bob' must not begin or end with whitespace (U+00A0 at index 0): no "
            "request can carry it (a header loses its spaces and tabs, any other id with "
            "whitespace at an end is refused with 400), so this limit applies to nobody; "
            "remove the whitespace",
        ),
    ]
    assert lint_text('version: 1\ndefault: 5\nusers:\n  "Zoë Müller": 1\n') == []


def test_lint_policy_takes_a_policy_too() -> None:
    policy = parse_policy("version: 1\ndefault: 5\nburst: 1ms\n", "p.yaml")
    assert lint_policy(policy) == lint_text("version: 1\ndefault: 5\nburst: 1ms\n", prompts=True)


@pytest.mark.parametrize("path", sorted(POLICIES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_policies_are_clean(path: Path) -> None:
    report = lint_all(path)
    assert report.loaded and report.ok(strict=True), report.findings
    assert report.findings == ()
    assert lint_policy(load_compiled(path)) == []


def test_every_policy_file_starts_with_comment_and_schema() -> None:
    for path in POLICIES.glob("*.yaml"):
        lines = path.read_text().splitlines()
        assert lines[0].startswith("# ")
        assert "# yaml-language-server: $schema=policy.schema.json" in lines[:6]


# -- lint_all ---------------------------------------------------------------------


def test_lint_all_with_a_bad_policy() -> None:
    bad = Path(__file__).parent / "fixtures" / "bad" / "rate_zero.yaml"
    report = lint_all(bad, Deployment(speculative=True, max_num_active_seqs=8))
    assert not report.loaded and not report.ok()
    assert [str(p) for p in report.problems] == [f"{bad}:4:10: users.alice: must be > 0"]
    assert report.findings[0] == Finding(
        "OR000", "error", "users.alice: must be > 0", f"{bad}:4:10"
    )
    assert codes(list(report.findings)) == ["OR000", "OR101"]
    assert report.to_json() == {
        "ok": False,
        "findings": [f._asdict() for f in report.findings],
        "policy": None,
        "shadow": [],
    }


def test_lint_all_strict() -> None:
    report = lint_all(POLICIES / "demo.yaml", deployment_from_args([]))
    assert report.loaded and report.ok() and not report.ok(strict=True)
    # no --host: vLLM binds every interface, where a body identity is anyone's claim
    assert codes(list(report.warnings)) == ["OR111", "OR113"]
    assert report.to_json(strict=True)["policy"] == report.policy.summary()  # type: ignore[union-attr]


# -- identity: the section, its keys file, and who can reach the server ----------

KEY = "sha256:" + "a" * 64


def identity_policy(tmp_path: Path, identity: str, keys: str | None = None) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\ndefault: {rate: 10, prompt: 1000}\nanonymous: {rate: 5, prompt: 500}\n"
        f"identity:\n{identity}"
    )
    if keys is not None:
        (tmp_path / "keys.yaml").write_text(keys)
    return path


API_KEY = "  source: api_key\n  keys: keys.yaml\n"


@pytest.mark.parametrize(
    ("argv", "warned"),
    [
        ([], "every interface (no --host: vLLM binds 0.0.0.0)"),
        (["--host", "0.0.0.0"], "--host 0.0.0.0"),
        (["--host", "10.1.2.3"], "--host 10.1.2.3"),
        (["--host", "::"], "--host ::"),
        (["--host", "gpu-7.internal"], "--host gpu-7.internal"),
        (["--host", "127.0.0.1"], None),
        (["--host", "127.3.2.1"], None),
        (["--host", "::1"], None),
        (["--host", "[::1]"], None),
        (["--host", "localhost"], None),
        (["--host", "0.0.0.0", "--uds", "/run/vllm.sock"], None),  # uds: host is ignored
    ],
)
def test_a_body_identity_on_a_reachable_server_is_a_warning(argv, warned) -> None:
    report = lint_all(POLICIES / "minimal.yaml", deployment_from_args([*CAPPED, *argv]))
    found = [f for f in report.findings if f.code == "OR113"]
    if warned is None:
        assert found == []
        return
    where = "--host" if "--host" in argv else "command line"
    assert found == [
        Finding(
            "OR113",
            "warning",
            f"identity.source is body and vLLM listens on {warned}: any client that reaches "
            "the port can name any user in vllm_xargs.output_rate_user and spend that user's "
            "budget; use 'source: api_key', or 'source: header' behind a gateway that sets "
            "it, or bind to 127.0.0.1",
            where,
        )
    ]


def test_header_and_api_key_sources_may_listen_anywhere(tmp_path: Path) -> None:
    dep = deployment_from_args([*CAPPED, "--host", "0.0.0.0"])
    header = identity_policy(tmp_path, "  source: header\n  header: x-user\n")
    assert lint_all(header, dep).findings == ()
    keyed = identity_policy(tmp_path, API_KEY, f"{KEY}: alice\n")
    assert lint_all(keyed, dep).findings == ()


def test_api_key_beside_vllms_own_api_key_is_an_error(tmp_path: Path) -> None:
    policy = identity_policy(tmp_path, API_KEY, f"{KEY}: alice\n")
    for argv in (["--api-key", "sk-1"], ["--api-key", "sk-1", "sk-2"], ["--api-key=sk-1"]):
        report = lint_all(policy, deployment_from_args([*CAPPED, "--host", "::1", *argv]))
        assert codes(list(report.findings)) == ["OR114"], argv
        assert report.errors[0].location == "--api-key" and not report.ok()
        assert "sk-1" not in report.errors[0].message  # keys are never repeated
    config = tmp_path / "serve.yaml"
    config.write_text("host: 127.0.0.1\napi-key: sk-1\nmax-num-seqs: 8\nmax-num-active-seqs: 6\n")
    report = lint_all(policy, deployment_from_config(config))
    assert [(f.code, f.location) for f in report.findings] == [("OR114", f"{config}:2:1")]
    # with a header source vLLM's --api-key is its own business: no finding
    header = identity_policy(tmp_path, "  source: header\n  header: x-user\n")
    dep = deployment_from_args([*CAPPED, "--host", "0.0.0.0", "--api-key", "k"])
    assert lint_all(header, dep).findings == ()


def test_an_empty_keys_file_is_a_warning(tmp_path: Path) -> None:
    policy = identity_policy(tmp_path, API_KEY, "# nobody yet\n")
    report = lint_all(policy)
    keys = tmp_path / "keys.yaml"
    assert report.findings == (
        Finding(
            "OR007",
            "warning",
            f"the keys file {keys} lists no key: every request will be refused with 401 (add "
            f"one with `outrate keys add USER --file {keys}`)",
            f"{policy}:6:9",
        ),
    )


def test_a_zero_byte_keys_file_is_an_error_and_braces_revoke_every_key(tmp_path: Path) -> None:
    """Zero bytes is a rewrite caught in the middle, not "no keys": the error
    says to write `{}`, which lints as the no-key warning (OR007)."""
    policy = identity_policy(tmp_path, API_KEY, "")
    keys = tmp_path / "keys.yaml"
    assert [(f.code, f.location, f.message) for f in lint_all(policy).findings] == [
        ("OR000", f"{policy}:6:9", f"identity.keys: keys file {keys} is not usable"),
        (
            "OR000",
            f"{keys}:1:1",
            "<file>: empty (0 bytes), as a file being rewritten in place is before its first "
            "write: write '{}' to revoke every key (until then a running server keeps its "
            "last good keys)",
        ),
    ]
    keys.write_text("{}\n")
    assert codes(list(lint_all(policy).findings)) == ["OR007"]


def test_keys_file_problems_are_located_errors(tmp_path: Path) -> None:
    policy = identity_policy(tmp_path, API_KEY, f"{KEY}: alice\n{KEY}: bob\nsha256:00: carol\n")
    report = lint_all(policy)
    keys = tmp_path / "keys.yaml"
    assert [(f.code, f.location, f.message) for f in report.findings] == [
        ("OR000", f"{policy}:6:9", f"identity.keys: keys file {keys} is not usable"),
        (
            "OR000",
            f"{keys}:2:1",
            "<root>: duplicate digest 'sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa...' (first at line 1)",
        ),
        (
            "OR000",
            f"{keys}:3:1",
            "sha256:00: must be 'sha256:' and 64 lowercase hex digits (the digest of a key, "
            "never the key itself; outrate keys add writes it)",
        ),
    ]
    (tmp_path / "keys.yaml").unlink()
    assert lint_all(policy).findings[1].message == "<file>: cannot read: No such file or directory"


# -- request rates (issue 41) ---------------------------------------------------


def test_request_rates_with_several_api_servers_warn_or120(tmp_path):
    from outrate.check.deployment import deployment_from_args
    from outrate.check.lint import lint_all

    path = tmp_path / "p.yaml"
    path.write_text("version: 1\ndefault: {rate: 20, requests: 5}\n")
    several = lint_all(path, deployment_from_args(["--api-server-count", "3"]))
    (finding,) = [f for f in several.findings if f.code == "OR120"]
    assert finding.location == "--api-server-count"
    assert "up to 3 x its request rate (default)" in finding.message
    one = lint_all(path, deployment_from_args(["-asc", "1"]))
    assert not [f for f in one.findings if f.code == "OR120"]
    ranks = lint_all(path, deployment_from_args(["-dp", "2"]))
    assert [f.code for f in ranks.findings if f.code == "OR120"] == ["OR120"]
    store = ["--outrate-store", "redis://h:1/0"]
    shared = lint_all(path, deployment_from_args(["-dp", "2", *store]))  # shared: exact
    assert not [f for f in shared.findings if f.code == "OR120"]
    assert "requests 5/s" in several.policy.summary()  # type: ignore[union-attr]


# -- a rate that leaves lending no time (OR012) ----------------------------------


def test_a_rate_no_step_can_give_beside_a_peak_warns_or012(tmp_path):
    """A committed rate whose streams, all `--max-num-seqs` of them (or its
    `max_streams`), need steps under 2 ms leaves every step its user runs
    in with no time to lend (docs/time-aware-borrowing.md): the large
    number written to mean no limit. Only where some rule has a peak."""
    from outrate.check.deployment import deployment_from_args

    path = tmp_path / "p.yaml"
    text = (
        "version: 1\n"
        "default: {rate: 20, peak: unlimited, prompt: unlimited}\n"
        "tiers:\n"
        "  bulk: {rate: 1000000, prompt: unlimited}\n"
        "users:\n"
        "  big: {rate: 900000, prompt: unlimited}\n"
        "  fine: {rate: 20000, prompt: unlimited}\n"
        "  capped: {rate: 5000, max_streams: 4, prompt: unlimited}\n"
        "  member: {tier: bulk}\n"
    )
    path.write_text(text)
    found = [f for f in lint_all(path).findings if f.code == "OR012"]
    assert [(f.location, f.message.split(":")[0]) for f in found] == [
        (f"{path}:4:16", "tiers.bulk"),  # 1,024 streams at 1e6 tok/s: 1.02 ms
        (f"{path}:6:15", "users.big"),
        (f"{path}:8:18", "users.capped"),  # its 4 streams at 5,000 tok/s: 0.80 ms
    ]
    assert "even 1024 streams (vLLM's largest default --max-num-seqs, 1024) need a step " \
        "every 1.02 ms" in found[0].message  # fmt: skip
    assert "even 4 streams (its max_streams) need a step every 0.80 ms" in found[2].message
    assert found[0].message.endswith("write rate: unlimited if no limit is meant")
    # the engine's own --max-num-seqs: fewer streams, so lower rates are past it too
    few = lint_all(path, deployment_from_args(["--max-num-seqs", "32"]))
    assert [f.message.split(":")[0] for f in few.findings if f.code == "OR012"] == [
        "tiers.bulk",
        "users.big",
        "users.fine",  # 32 / 20,000 tok/s: 1.60 ms
        "users.capped",
    ]
    # no peak anywhere: nothing is lent, so nothing is blocked
    path.write_text(text.replace("peak: unlimited, ", ""))
    assert not [f for f in lint_all(path).findings if f.code == "OR012"]
    # a prompt peak lends too
    lends_prompts = "prompt: {rate: 5, peak: 50}"
    path.write_text(text.replace("peak: unlimited, prompt: unlimited", lends_prompts))
    assert len([f for f in lint_all(path).findings if f.code == "OR012"]) == 3


def test_or012_on_a_hand_built_policy() -> None:
    from outrate.check.lending import unlendable_rates

    lender = Limit(20, 10**8, rule="default", peak="unlimited")
    c = CompiledPolicy("built", lender, Limit(10**6, 10**8, rule="anonymous"), 10**8)
    assert [(f.code, f.location) for f in unlendable_rates(c, 64)] == [("OR012", "built")]
    assert unlendable_rates(c, None)[0].message.startswith("anonymous: rate 1000000 tok/s")

"""`outrate lint` refuses exactly the `--outrate-*` flags the server refuses
at start: every flag, with bad values, through lint (`outrate lint POLICY --
ARGV`) and through vLLM's own parser with the plugin (`EngineArgs.from_cli_args`,
what `vllm serve` runs), with the same verdict. Both apply
`outrate.check.outrate_flags`; lint used to say `ok` to
`--outrate-store-engines 0` and to store flags without a store."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from outrate.check.deployment import DeploymentError, deployment_from_args
from outrate.check.outrate_flags import (
    FLAGS,
    FlagError,
    check_flags,
)
from outrate.cli import app

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "policies" / "demo.yaml")
MODEL = ["--model", "models/tiny-llama"]
POLICY = ["--outrate-policy", DEMO]
STORE = ["--outrate-store", "redis://127.0.0.1:6379/0"]
runner = CliRunner()


def cases(tmp: Path) -> list[tuple[str, list[str], bool]]:
    """(the flag under test, the argv after the model, refused?)."""
    busy = tmp / "busy"  # trace.dp1.jsonl is a directory: rank 1 cannot write its trace
    (busy / "trace.dp1.jsonl").mkdir(parents=True)
    return [
        ("--outrate-policy", [*POLICY], False),
        ("--outrate-policy", ["--outrate-policy", str(tmp / "none.yaml")], True),
        ("--outrate-reload", [*POLICY, "--outrate-reload", "poll"], False),
        ("--outrate-reload", [*POLICY, "--outrate-reload", "sometimes"], True),
        ("--outrate-trace", [*POLICY, "--outrate-trace", str(tmp / "t.jsonl")], False),
        ("--outrate-trace", [*POLICY, "--outrate-trace", str(tmp)], True),
        ("--outrate-trace", [*POLICY, "--outrate-trace", str(tmp / "no" / "t.jsonl")], True),
        (
            "--outrate-trace",
            [*POLICY, *STORE, "-dp", "2", "--outrate-trace", str(busy / "trace.jsonl")],
            True,
        ),
        (
            "--outrate-trace-max-bytes",
            [*POLICY, "--outrate-trace", str(tmp / "t.jsonl"), "--outrate-trace-max-bytes", "1"],
            False,
        ),
        (
            "--outrate-trace-max-bytes",
            [*POLICY, "--outrate-trace", str(tmp / "t.jsonl"), "--outrate-trace-max-bytes", "0"],
            True,
        ),
        ("--outrate-trace-max-bytes", [*POLICY, "--outrate-trace-max-bytes", "100"], True),
        ("--outrate-quota-file", [*POLICY, "--outrate-quota-file", str(tmp / "q.json")], False),
        ("--outrate-quota-file", [*POLICY, "--outrate-quota-file", str(tmp)], True),
        ("--outrate-quota-file", [*POLICY, "--outrate-quota-file", str(tmp / "no" / "q")], True),
        ("--outrate-store", [*POLICY, *STORE], False),
        ("--outrate-store", [*POLICY, "--outrate-store", "http://h:6379"], True),
        ("--outrate-store-fallback", [*POLICY, *STORE, "--outrate-store-fallback", "pause"], False),
        ("--outrate-store-fallback", [*POLICY, *STORE, "--outrate-store-fallback", "x"], True),
        ("--outrate-store-fallback", [*POLICY, "--outrate-store-fallback", "full"], True),
        ("--outrate-store-hold-s", [*POLICY, *STORE, "--outrate-store-hold-s", "1"], False),
        ("--outrate-store-hold-s", [*POLICY, *STORE, "--outrate-store-hold-s", "3600"], False),
        ("--outrate-store-hold-s", [*POLICY, *STORE, "--outrate-store-hold-s", "nan"], True),
        ("--outrate-store-hold-s", [*POLICY, *STORE, "--outrate-store-hold-s", "inf"], True),
        ("--outrate-store-hold-s", [*POLICY, *STORE, "--outrate-store-hold-s", "0"], True),
        ("--outrate-store-hold-s", [*POLICY, *STORE, "--outrate-store-hold-s", "3601"], True),
        ("--outrate-store-hold-s", [*POLICY, *STORE, "--outrate-store-hold-s", "soon"], True),
        ("--outrate-store-hold-s", [*POLICY, "--outrate-store-hold-s", "5"], True),
        ("--outrate-store-engines", [*POLICY, *STORE, "--outrate-store-engines", "4096"], False),
        ("--outrate-store-engines", [*POLICY, *STORE, "--outrate-store-engines", "0"], True),
        ("--outrate-store-engines", [*POLICY, *STORE, "--outrate-store-engines", "-1"], True),
        (
            "--outrate-store-engines",
            [*POLICY, *STORE, "--outrate-store-engines", "99999999999999999999999"],
            True,
        ),
        ("--outrate-store-engines", [*POLICY, *STORE, "--outrate-store-engines", "3.5"], True),
        ("--outrate-store-engines", [*POLICY, "--outrate-store-engines", "3"], True),
        ("--outrate-store-lease-ms", [*POLICY, *STORE, "--outrate-store-lease-ms", "1000"], False),
        ("--outrate-store-lease-ms", [*POLICY, *STORE, "--outrate-store-lease-ms", "0"], True),
        ("--outrate-store-lease-ms", [*POLICY, *STORE, "--outrate-store-lease-ms", "1001"], True),
        ("--outrate-store-lease-ms", [*POLICY, "--outrate-store-lease-ms", "20"], True),
        (
            "--default-user-output-tokens-per-second",
            ["--default-user-output-tokens-per-second", "100"],
            False,
        ),
        (
            "--default-user-output-tokens-per-second",
            ["--default-user-output-tokens-per-second", "-5"],
            True,
        ),
        (
            "--default-user-output-tokens-per-second",
            ["--default-user-output-tokens-per-second", "nan"],
            True,
        ),
        (
            "--default-user-output-tokens-per-second",
            [*POLICY, "--default-user-output-tokens-per-second", "5"],
            True,
        ),
        ("--user-output-tokens-per-second", ["--user-output-tokens-per-second", '{"a": 5}'], False),
        ("--user-output-tokens-per-second", ["--user-output-tokens-per-second", '{"a": 0}'], True),
        ("--user-output-tokens-per-second", ["--user-output-tokens-per-second", "{a"], True),
        (
            "--user-output-tokens-per-second",
            [*POLICY, "--user-output-tokens-per-second", "{}"],
            True,
        ),
    ]


def lint_verdict(argv: list[str]) -> tuple[bool, str]:
    """(refused, what lint said): `outrate lint demo.yaml -- ARGV`."""
    result = runner.invoke(app, ["lint", DEMO, "--", *MODEL, *argv])
    assert result.exit_code in (0, 1), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    return result.exit_code == 1, result.stderr


@pytest.fixture(scope="module")
def vllm_parser():  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_integration.startup import plugin

    plugin.register()
    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def server_verdict(parser, argv: list[str]) -> tuple[bool, str]:  # type: ignore[no-untyped-def]
    """(refused, why): vLLM's parser and the plugin's startup (`from_cli_args`)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        AsyncEngineArgs.from_cli_args(parser.parse_args([*MODEL, *argv]))
    except SystemExit as e:
        return True, str(e.code)
    return False, ""


@pytest.mark.vllm
def test_lint_and_the_server_refuse_the_same_flags(vllm_parser, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from vllm_integration.startup.plugin import OUTRATE_FLAGS

    walked = cases(tmp_path)
    assert {flag for flag, _, _ in walked} == {f.name for f in FLAGS} == set(OUTRATE_FLAGS)
    differ, said_by = [], []
    for flag, argv, refused in walked:
        lint_refused, said = lint_verdict(argv)
        server_refused, why = server_verdict(vllm_parser, argv)
        said_by.append(f"{flag} {argv[-1]!r}:\n  lint   {said.strip()}\n  server {why}")
        if not lint_refused == server_refused == refused:
            differ.append((argv, lint_refused, server_refused, refused))
    capsys.readouterr()  # argparse's usage lines
    print("\n".join(said_by))
    assert differ == []


def test_lint_said_ok_to_these_and_now_refuses_them(tmp_path: Path) -> None:
    """The issue's cases, with the server's own words (one definition)."""
    for argv, message in [
        (
            [*STORE, "--outrate-store-engines", "0"],
            "--outrate-store-engines: must be in 1..4096, got 0",
        ),
        ([*STORE, "--outrate-store-engines", "-1"], "must be in 1..4096, got -1"),
        (
            [*STORE, "--outrate-store-engines", "99999999999999999999999"],
            "must be in 1..4096, got 99999999999999999999999",
        ),
        (["--outrate-store-engines", "3"], "--outrate-store-engines needs --outrate-store"),
        ([*STORE, "--outrate-store-hold-s", "nan"], "must be in 1..3600, got nan"),
        ([*STORE, "--outrate-store-hold-s", "0"], "must be in 1..3600, got 0"),
        (["--outrate-store-fallback", "full"], "--outrate-store-fallback needs --outrate-store"),
        (
            ["--outrate-store-fallback", "full", "--outrate-store-hold-s", "5"],
            "--outrate-store-fallback and --outrate-store-hold-s need --outrate-store",
        ),
    ]:
        refused, said = lint_verdict(argv)
        assert refused and message in said, (argv, said)
        with pytest.raises(DeploymentError, match="^"):
            deployment_from_args(argv)


def test_the_server_check_says_the_same_words() -> None:
    """What `outrate_settings` raises (the plugin prints it after `outrate: `)."""
    store = {"--outrate-store": "redis://h:6379/0"}
    for values, message in [
        (
            {**store, "--outrate-store-engines": 0},
            "--outrate-store-engines must be in 1..4096, got 0",
        ),
        (
            {**store, "--outrate-store-hold-s": math.nan},
            "--outrate-store-hold-s must be in 1..3600, got nan",
        ),
        ({"--outrate-store-engines": 3}, "--outrate-store-engines needs --outrate-store"),
        ({"--outrate-trace-max-bytes": 9}, "--outrate-trace-max-bytes needs --outrate-trace"),
        ({"--outrate-reload": "x"}, "--outrate-reload must be one of watch, poll, off, got 'x'"),
    ]:
        with pytest.raises(FlagError) as info:
            check_flags(values)
        assert str(info.value) == message


def test_a_vllm_config_file_is_checked_the_same_way(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("outrate_store: redis://h:6379/0\noutrate_store_engines: 3.0\n")
    refused, said = lint_verdict(["--config", str(config)])
    assert refused and f"{config}:2:1: outrate_store_engines: expected an integer (got 3.0)" in said
    config.write_text("outrate_store_hold_s: 5\n")
    refused, said = lint_verdict(["--config", str(config)])
    assert refused and "--outrate-store-hold-s needs --outrate-store" in said


def test_lint_lints_the_policy_the_serve_flags_name(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndefault: -1\n")
    result = runner.invoke(app, ["lint", DEMO, "--", *MODEL, "--outrate-policy", str(bad)])
    assert result.exit_code == 1
    assert f"{bad}:2:10: default: must be > 0" in result.stderr
    same = runner.invoke(app, ["lint", DEMO, "--", *MODEL, "--outrate-policy", DEMO])
    assert same.exit_code == 0 and same.stdout.count("\nok") + same.stdout.startswith("ok") == 1


def test_lint_json_says_why_as_json() -> None:
    """Where JSON was asked for, a refused flag is a JSON error object too."""
    import json

    argv = ["lint", DEMO, "--format", "json", "--", *MODEL, "--outrate-store-engines", "3"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 1
    assert json.loads(result.stdout) == {
        "ok": False,
        "errors": [{"message": "--outrate-store-engines needs --outrate-store"}],
    }

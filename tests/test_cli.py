"""The `outrate` command: exit codes (0 ok, 1 policy/deployment errors, 2 usage),
what goes to stdout and stderr, and that it never imports vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from outrate.cli import app, schema_text

ROOT = Path(__file__).parent.parent
POLICIES = ROOT / "policies"
BAD = ROOT / "tests" / "fixtures" / "bad"
DEPLOY = ROOT / "tests" / "fixtures" / "deploy"

runner = CliRunner()


def run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_help_lists_commands() -> None:
    code, out, _ = run("--help")
    assert code == 0
    for command in ("lint", "schema", "serve"):
        assert command in out


def test_lint_ok() -> None:
    path = POLICIES / "seed.yaml"
    code, out, err = run("lint", path)
    assert code == 0 and err == ""
    assert out == (
        f"ok: outrate policy from {path}: 2 users, 0 tiers, 0 patterns; "
        "default 100 tok/s burst 100ms; anonymous 100 tok/s burst 100ms\n"
    )


def test_lint_policy_errors_exit_1_with_exact_messages() -> None:
    path = BAD / "many_problems.yaml"
    code, out, err = run("lint", path)
    assert code == 1
    assert err.splitlines() == [
        f"{path}:2:10: default: must be > 0",
        f"{path}:3:8: burst: must be a duration like '100ms' or '0.25s' (got 'soon')",
        f"{path}:5:10: users.alice: must be a number of tokens per second or 'unlimited' "
        "(got 'fast')",
        f"{path}:6:19: users.bob: unknown key 'max_stream' (did you mean 'max_streams'?)",
        f"{path}:8:14: match[0].pattern: must not be empty",
        f"{path}:9:11: match[0].tier: unknown tier 'gold' (no tiers are defined)",
    ]
    assert out == f"{path}: failed: 6 errors, 0 warnings\n"


def test_lint_missing_policy_file_is_a_policy_error(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    code, _, err = run("lint", path)
    assert code == 1
    assert err == f"{path}:1:1: <file>: cannot read: No such file or directory\n"


def test_lint_warnings_and_strict(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\ndefault: 5\nburst: 10ms\n")
    code, out, err = run("lint", path)
    assert code == 0
    assert err.startswith(f"{path}:3:8: OR001 warning: burst 10ms is shorter than an engine step")
    assert out.startswith(f"ok, 1 warning: outrate policy from {path}: ")
    code, out, err = run("lint", path, "--strict")
    assert code == 1
    assert out == f"{path}: failed (--strict): 0 errors, 1 warning\n"


def test_lint_with_vllm_config() -> None:
    code, out, err = run("lint", POLICIES / "demo.yaml", "--vllm-config", DEPLOY / "good.yaml")
    assert (code, err) == (0, "")
    code, out, err = run(
        "lint", POLICIES / "demo.yaml", "--vllm-config", DEPLOY / "speculative.yaml"
    )
    assert code == 1
    assert err == (
        f"{DEPLOY / 'speculative.yaml'}:3:1: OR101 error: speculative decoding is not "
        "supported: draft tokens are sampled without passing the per-user limiter\n"
    )
    assert out == f"{POLICIES / 'demo.yaml'}: failed: 1 error, 0 warnings\n"


def test_lint_with_serve_args_after_double_dash() -> None:
    code, _, err = run(
        "lint", POLICIES / "demo.yaml", "--", "serve", "/models/tiny", "-dp", "2",
        "--max-num-active-seqs", "8",
    )  # fmt: skip
    assert code == 1
    assert err.startswith("-dp: OR102 error: data parallel size 2 is not supported: ")
    # config first, then the args override it
    code, _, err = run(
        "lint", POLICIES / "demo.yaml", "--vllm-config", DEPLOY / "no_chunked_prefill.yaml",
        "--", "--enable-chunked-prefill",
    )  # fmt: skip
    assert (code, err) == (0, "")


def test_lint_bad_deployment_input_exits_1() -> None:
    code, _, err = run("lint", POLICIES / "demo.yaml", "--", "--max-num-seqs", "lots")
    assert code == 1
    assert err == "--max-num-seqs: expected an integer (got 'lots')\n"


def test_lint_json() -> None:
    code, out, err = run(
        "lint", POLICIES / "demo.yaml", "--format", "json", "--", "--no-enable-chunked-prefill"
    )
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["ok"] is True
    assert [f["code"] for f in data["findings"]] == ["OR111", "OR112"]
    assert set(data["findings"][0]) == {"code", "severity", "message", "location"}
    assert data["policy"].startswith("outrate policy from ")


def test_lint_json_with_a_bad_policy() -> None:
    path = BAD / "rate_zero.yaml"
    code, out, err = run("lint", path, "--format=json")
    assert code == 1 and err == ""
    assert json.loads(out) == {
        "ok": False,
        "findings": [
            {
                "code": "OR000",
                "severity": "error",
                "message": "users.alice: must be > 0",
                "location": f"{path}:4:10",
            }
        ],
        "policy": None,
        "shadow": [],
    }


@pytest.mark.parametrize(
    "args",
    [
        ["lint"],  # missing policy
        ["lint", "p.yaml", "--strcit"],  # unknown option
        ["lint", "p.yaml", "--format", "xml"],  # bad choice
        ["lint", "p.yaml", "--vllm-config"],  # option without value
        ["frobnicate"],  # unknown command
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    code, _, _ = run(*args)
    assert code == 2


def test_schema_matches_shipped_files() -> None:
    code, out, _ = run("schema")
    assert code == 0
    assert out == schema_text()
    assert json.loads(out)["title"] == "outrate policy"
    assert (POLICIES / "policy.schema.json").read_text() == out
    assert (ROOT / "outrate" / "policy.schema.json").read_text() == out


def test_core_never_imports_vllm() -> None:
    """`outrate lint` must start fast and run where vLLM is not installed."""
    script = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "import outrate.cli\n"
        "r = CliRunner().invoke(outrate.cli.app, ['lint', sys.argv[1], '--', '-tp', '2'])\n"
        "assert r.exit_code == 0, r.output\n"
        "heavy = {m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'watchdog'}\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(POLICIES / "tiers.yaml")], check=True, cwd=ROOT
    )


def test_lint_lists_the_rules_in_shadow(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\ndefault: 100\ntiers:\n  pro: {rate: 50, shadow: true}\n"
        "users:\n  alice: {rate: 20, shadow: true}\n  bob: {tier: pro}\n  carol: 5\n"
    )
    result = runner.invoke(app, ["lint", str(policy)])
    assert result.exit_code == 0
    assert result.stdout.splitlines()[-1] == (
        "shadow (counted, not enforced): tiers.pro, users.alice"
    )
    result = runner.invoke(app, ["lint", "--format", "json", str(policy)])
    assert json.loads(result.stdout)["shadow"] == ["tiers.pro", "users.alice"]

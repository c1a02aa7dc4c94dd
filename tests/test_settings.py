"""The two typed settings records: what travels to the engine core
(`EngineSettings`) and every environment variable outrate reads (`Env`)."""

from __future__ import annotations

import pickle

import pytest

from outrate import env
from outrate.env import Env
from outrate.errors import OutrateError
from vllm_integration.common.settings import EngineSettings


def test_engine_settings_travel_as_a_plain_dict_and_come_back_equal():
    s = EngineSettings(
        policy="/etc/outrate/policy.yaml",
        reload="poll",
        trace="/var/log/trace.jsonl",
        trace_max_bytes=1000,
        store="redis://r:6379/0",
        store_fallback="full",
        data_parallel_size=2,
        vllm_api_key=True,
    )
    raw = s.to_config()
    assert type(raw) is dict and all(isinstance(k, str) for k in raw)
    assert pickle.loads(pickle.dumps(raw)) == raw  # vLLM pickles and hashes its config
    assert EngineSettings.from_config(raw) == s
    with pytest.raises(AttributeError):
        s.reload = "off"  # type: ignore[misc]  # frozen


def test_a_field_this_version_does_not_know_is_refused_by_name():
    raw = {**EngineSettings().to_config(), "store_tls": True, "aaa": 1}
    with pytest.raises(OutrateError, match=r"does not know: aaa, store_tls \(the API server"):
        EngineSettings.from_config(raw)


def test_env_reads_each_variable_by_its_one_name():
    environ = {
        env.IDENTITY_SECRET: "ab" * 16,
        env.STORE_PASSWORD: "pw",
        env.API_SETTINGS: "{}",
        env.METRICS_DIR: "12:/tmp/x",
        env.MAX_POLICY_BYTES: "100",
        env.SHM_SPIN_SLEEP_US: "0",
        env.STORE_SSL_PASSWORD: "kpw",
        env.MAX_WORKLOAD_BYTES: "200",
        env.MAX_TRACE_BYTES: "300",
        "OUTRATE_SOMETHING_ELSE": "ignored",
    }
    e = Env.read(environ)
    assert e == Env("ab" * 16, "pw", "{}", "12:/tmp/x", "100", "0", "kpw", "200", "300")
    assert [e.file_limit(n) for n in (env.MAX_POLICY_BYTES, env.MAX_WORKLOAD_BYTES)] == [
        "100",
        "200",
    ]
    assert e.file_limit(env.MAX_TRACE_BYTES) == "300"
    assert Env.read({}) == Env()  # unset: the readers' defaults apply
    names = [v for k, v in vars(env).items() if k.isupper()]
    assert all(n.startswith("OUTRATE_") for n in names) and len(set(names)) == len(names) == 9

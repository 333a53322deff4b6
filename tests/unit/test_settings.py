"""The settings model: precedence of its sources, validation with clear messages, the JSON schema."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from controlplane.settings import Settings, SettingsError

pytestmark = [pytest.mark.unit]


@pytest.fixture(autouse=True)
def _clean_env(no_epd_env):
    pass


def test_defaults_are_valid_and_build_engine_configs():
    s = Settings.load()
    assert (s.mode, s.api.host, s.api.port, s.redis.prefix) == ("disaggregated", "127.0.0.1", 8000, "epd")
    cfg = s.decode.engine.engine_config()
    assert cfg.block_size == 16 and cfg.kv_cache_bytes == 256 * 2**20


def test_precedence_yaml_then_env_then_cli(tmp_path, monkeypatch):
    path = tmp_path / "epd.yaml"
    path.write_text("decode:\n  replicas: 2\n  engine:\n    kv_cache_bytes: 134217728\napi:\n  port: 8100\n")
    s = Settings.load(path)
    assert (s.decode.replicas, s.decode.engine.kv_cache_bytes, s.api.port) == (2, 134217728, 8100)
    monkeypatch.setenv("EPD_DECODE__REPLICAS", "3")
    monkeypatch.setenv("EPD_TRANSFER__CODEC_POLICY", "int8,0=bf16,-1=bf16")
    s = Settings.load(path)
    assert s.decode.replicas == 3 and s.transfer.codec_policy == "int8,0=bf16,-1=bf16"
    assert s.decode.engine.kv_cache_bytes == 134217728  # untouched nested values survive the merge
    s = Settings.load(path, {"decode": {"replicas": 5}})
    assert s.decode.replicas == 5 and s.api.port == 8100


@pytest.mark.parametrize("overrides, message", [
    ({"decode": {"replicas": -1}}, "decode.replicas: Input should be greater than or equal to 0"),
    ({"decode": {"replicaz": 1}}, "decode.replicaz: unknown setting"),
    ({"transfer": {"codec_policy": "int2"}}, "unknown codec 'int2'"),
    ({"prefill": {"engine": {"block_size": 32}}}, "block_size (32) and decode.engine.block_size (16) must match"),
    ({"decode": {"engine": {"block_size": 24}}}, "block_size must be a power of two"),
    ({"transfer": {"token": "short"}}, "at least 16 characters"),
    ({"transfer": {"tls_ca": "/ca.pem"}}, "needs all three"),
    ({"decode": {"engine": {"max_num_seqs": 64, "max_num_batched_tokens": 8}}}, "must be >= max_num_seqs"),
    ({"api": {"port": 70000}}, "api.port"),
    ({"api": {"sse_keepalive_s": 0.01}}, "api.sse_keepalive_s: 0.01 s would send a comment many times a second"),
    ({"api": {"sse_keepalive_s": -1}}, "api.sse_keepalive_s: Input should be greater than or equal to 0"),
    ({"redis": {"prefix": "bad prefix"}}, "redis.prefix"),
    ({"scheduler": {"queue_size": 0}}, "scheduler.queue_size: Input should be greater than or equal to 1"),
    ({"decode": {"replicas": 0}}, "both have replicas"),
    ({"mode": "colocated", "prefill": {"replicas": 2}}, "colocated mode has no prefill pool"),
    ({"mode": "colocated", "encode": {"replicas": 1}}, "colocated mode has no encode pool"),
    ({"mode": "aggregated"}, "mode: Input should be 'disaggregated' or 'colocated'"),
    ({"decode": {"ray_resources": {"epd-decode": -1}}}, "ray_resources need a name and an amount >= 0"),
    ({"decode": {"engine": {"dtype": "bfloat16"}}},
     "prefill.engine.dtype (float32) and decode.engine.dtype (bfloat16) must match"),
    ({"transfer": {"transport": "cuda_ipc"}, "prefill": {"engine": {"device": "cuda"}}},
     "transfer.transport cuda_ipc moves KV between GPUs; prefill.engine.device is cuda and decode.engine.device "
     "is cpu"),
    ({"decode": {"num_gpus": 1, "engine": {"device": "cuda:1"}}},
     "decode: engine.device cuda:1 with num_gpus 1.0: under Ray, cuda:k is the k-th GPU Ray reserves for the "
     "replica, numbered from 0; use cuda"),
    ({"decode": {"num_gpus": 1, "gpu_visibility": "all"}},
     "decode.gpu_visibility: Input should be 'host' or 'reserved'"),
])
def test_bad_settings_are_refused_with_the_field_named(overrides, message):
    with pytest.raises(SettingsError) as err:
        Settings.load(None, overrides)
    assert message in str(err.value)


def test_pools_on_gpus_that_ray_shows_them_are_accepted():
    s = Settings.load(None, {"encode": {"replicas": 0}, **{pool: {"num_gpus": 2, "engine": {"device": "cuda:1",
                                                                                              "dtype": "bfloat16"}}
                                                           for pool in ("prefill", "decode")},
                             "transfer": {"transport": "cuda_ipc"}})
    assert s.decode.engine.device == "cuda:1"
    # the encode pool's dtype is checked once the model is known to have a vision tower (serve.fit_pools)
    Settings.load(None, {"prefill": {"engine": {"dtype": "bfloat16"}}, "decode": {"engine": {"dtype": "bfloat16"}}})
    Settings.load(None, {"mode": "colocated", "decode": {"num_gpus": 0.5, "engine": {"device": "cuda:0",
                                                                                      "dtype": "bfloat16"}}})


def test_colocated_mode_needs_only_the_decode_pool():
    s = Settings.load(None, {"mode": "colocated", "decode": {"replicas": 2}})
    assert s.mode == "colocated" and s.decode.replicas == 2
    assert Settings.load(None, {"mode": "colocated", "prefill": {"replicas": 0}}).prefill.replicas == 0


def test_bad_yaml_files_are_refused(tmp_path):
    with pytest.raises(SettingsError, match="cannot read the config file"):
        Settings.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode: [1, 2\n")
    with pytest.raises(SettingsError, match="not valid YAML"):
        Settings.load(bad)
    bad.write_text("- a list\n")
    with pytest.raises(SettingsError, match="must hold a mapping"):
        Settings.load(bad)


def test_a_yaml_syntax_error_says_where_in_one_line(tmp_path):
    """PyYAML puts the line and column on a second line, which the CLI's one-line error dropped."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: colocated\ndecode:\n  replicas: 1\n    num_cpus: 2\n")
    with pytest.raises(SettingsError) as err:
        Settings.load(bad)
    assert str(err.value) == f"{bad} is not valid YAML: mapping values are not allowed here (line 4, column 13)"
    bad.write_text("mode: colocated\napi: {host: 'x\n")  # the context says where the quote opened
    with pytest.raises(SettingsError) as err:
        Settings.load(bad)
    assert str(err.value).startswith(f"{bad} is not valid YAML: while scanning a quoted scalar (line 2, column 13): ")
    assert "\n" not in str(err.value)


def test_secrets_are_masked_in_the_effective_settings():
    s = Settings.load(None, {"transfer": {"token": "x" * 32}, "api": {"admin_token": "y" * 20}})
    data = s.redacted()
    assert data["transfer"]["token"] == "**********" and data["api"]["admin_token"] == "**********"
    assert "x" * 32 not in json.dumps(data)
    assert s.transfer.token.get_secret_value() == "x" * 32


def test_json_schema_covers_every_section_with_constraints():
    schema = Settings.model_json_schema()
    assert set(schema["properties"]) == {"model", "mode", "encode", "prefill", "decode", "replicas_file", "transfer",
                                         "scheduler", "api", "redis", "ray", "observability"}
    pool = schema["$defs"]["PoolSettings"]["properties"]["replicas"]
    assert pool["minimum"] == 0 and pool["maximum"] == 1000
    assert schema["$defs"]["TransferSettings"]["additionalProperties"] is False


def test_config_show_prints_effective_settings_without_secrets(tmp_path):
    path = tmp_path / "epd.yaml"
    path.write_text("transfer:\n  token: supersecrettoken1234\n")
    env = {"EPD_DECODE__REPLICAS": "2", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "controlplane.cli", "config", "show", "--config", str(path),
                          "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["decode"]["replicas"] == 2 and data["transfer"]["token"] == "**********"
    assert "supersecrettoken1234" not in out.stdout
    bad = subprocess.run([sys.executable, "-m", "controlplane.cli", "config", "show"], capture_output=True,
                         text=True, env={**env, "EPD_DECODE__REPLICAS": "-3"}, timeout=60)
    assert bad.returncode == 2 and "decode.replicas" in bad.stderr and "Traceback" not in bad.stderr


def _config_show(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controlplane.cli", "config", "show", *args], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", **env}, timeout=60)


@pytest.mark.parametrize("url, shown", [
    ("redis://:hunter2@h:6379/0", "redis://:***@h:6379/0"),
    ("rediss://user:hunter2@h:6380/1", "rediss://user:***@h:6380/1"),
    ("redis://h:6379/0?password=hunter2&db=1", "redis://h:6379/0?password=***&db=1"),
    ("redis://h:6379/0", "redis://h:6379/0"),
])
def test_passwords_in_the_redis_url_are_masked(url, shown, monkeypatch):
    monkeypatch.setenv("EPD_REDIS__URL", url)
    s = Settings.load()
    assert s.redis.url == url  # the real value is what serve connects with
    assert s.redacted()["redis"]["url"] == shown
    assert "hunter2" not in json.dumps(s.redacted())


@pytest.mark.parametrize("password", ["hunt/er2", "hunt#er2", "hunt?er2"])
def test_a_password_that_breaks_the_url_is_refused_without_showing_it(password, monkeypatch):
    """'/', '?' or '#' end a URL's authority, so the parser finds no password; the refusal masks it anyway."""
    monkeypatch.setenv("EPD_REDIS__URL", f"redis://:{password}@h:6379/0")
    with pytest.raises(SettingsError) as err:
        Settings.load()
    assert "not a Redis URL" in str(err.value) and "redis://:***@h:6379/0" in str(err.value)
    assert "hunt" not in str(err.value) and "er2" not in str(err.value)


@pytest.mark.parametrize("password", ["Qx7@Zw/K9v", "Qx7@Zw?K9v", "Qx7@Zw#K9v"])
def test_a_password_with_an_at_sign_and_a_slash_is_masked_whole(password, monkeypatch):
    """The parser takes "Qx7" for the password and "Zw" for the host: masking its idea of the password
    showed the rest ("Zw/K9v@h...")."""
    from controlplane.settings import mask_url

    url = f"redis://:{password}@h:6379/0"
    assert mask_url(url) == "redis://:***@h:6379/0"
    monkeypatch.setenv("EPD_REDIS__URL", url)
    try:
        shown = json.dumps(Settings.load().redacted())
    except SettingsError as exc:
        shown = str(exc)
    assert "Qx7" not in shown and "Zw" not in shown and "K9v" not in shown


@pytest.mark.parametrize("url, shown", [
    ("redis://h:6379/0?password=hunter2", "redis://h:6379/0?password=***"),
    ("redis://u:hunter2@h:6379/0?PASSWORD=hunter2&db=1", "redis://u:***@h:6379/0?PASSWORD=***&db=1"),
])
def test_a_state_connection_names_its_url_without_the_password_in_any_place(url, shown):
    """redis-py reads a `password=` query parameter too: the URL a StateConnection shows in its errors
    and logs masks it as `epd config show` does."""
    from controlplane.settings import mask_url
    from controlplane.state import connect

    conn = connect(url, "masked", verify=False)
    try:
        assert conn.url == shown == mask_url(url)
    finally:
        conn.close()


def test_config_show_masks_the_redis_password():
    out = _config_show({"EPD_REDIS__URL": "redis://:hunter2@h:6379/0"}, "--json")
    assert out.returncode == 0, out.stderr
    assert "hunter2" not in out.stdout and json.loads(out.stdout)["redis"]["url"] == "redis://:***@h:6379/0"


@pytest.mark.parametrize("name, message", [
    ("EPD_DECODE_REPLICAS", "EPD_DECODE_REPLICAS (did you mean EPD_DECODE__REPLICAS? nested settings use a "
                            "double underscore)"),
    ("EPD_DECODE_ENGINE_DTYPE", "did you mean EPD_DECODE__ENGINE__DTYPE?"),
    ("EPD_TRANSFER_CODEC_POLICY", "did you mean EPD_TRANSFER__CODEC_POLICY?"),
    ("EPD_DECODE_REPLICAZ", "EPD_DECODE_REPLICAZ (nested settings use a double underscore: EPD_DECODE__<FIELD>)"),
    ("EPD_BOGUS", "unknown setting variable: EPD_BOGUS;"),
    ("epd_bogus", "unknown setting variable: epd_bogus;"),  # read case-insensitively, so refused likewise
])
def test_unknown_epd_variables_are_refused_with_a_hint(name, message, monkeypatch):
    monkeypatch.setenv(name, "5")
    with pytest.raises(SettingsError) as err:
        Settings.load()
    assert message in str(err.value)


def test_unknown_fields_inside_a_section_are_refused_with_their_path(monkeypatch):
    monkeypatch.setenv("EPD_DECODE__REPLICAZ", "1")
    with pytest.raises(SettingsError, match="decode.replicaz: unknown setting"):
        Settings.load()


def test_config_show_refuses_a_misspelt_variable_in_one_line():
    out = _config_show({"EPD_DECODE_REPLICAS": "5"})
    assert out.returncode == 2 and "Traceback" not in out.stderr and out.stderr.count("\n") == 1
    assert "EPD_DECODE__REPLICAS" in out.stderr


def test_variables_read_outside_the_model_are_allowed(monkeypatch, tmp_path):
    from controlplane.settings import ENV_OUTSIDE_SETTINGS
    for name in ENV_OUTSIDE_SETTINGS:
        monkeypatch.setenv(name, str(tmp_path))
    assert Settings.load().decode.replicas == 1


def test_every_epd_variable_the_repository_reads_is_a_setting_or_allow_listed():
    """A new os.environ["EPD_X"] (or an EPD_X in the Makefile or the chart) that is not a setting must join
    ENV_OUTSIDE_SETTINGS, or Settings.load would refuse the variable it reads."""
    import re
    from pathlib import Path

    from controlplane.settings import ENV_OUTSIDE_SETTINGS
    from controlplane.settings_input import nested_spelling

    root = Path(__file__).resolve().parents[2]
    reads = re.compile(r"""(?:environ(?:\.get)?\s*[\(\[]\s*|getenv\(\s*)["'](EPD_[A-Z0-9_]+)["']""")
    found: dict[str, str] = {}
    for folder in ("controlplane", "workers", "kvtransfer", "scripts", "tests"):
        for path in (root / folder).rglob("*.py"):
            if path.resolve() == Path(__file__).resolve():
                continue  # this file names bad variables on purpose
            for name in reads.findall(path.read_text(errors="replace")):
                found.setdefault(name, str(path.relative_to(root)))
    for path in [root / "Makefile", *(root / "helm").rglob("*.yaml")]:
        for name in re.findall(r"\b(EPD_[A-Z0-9_]*[A-Z0-9])\b", path.read_text(errors="replace")):
            found.setdefault(name, str(path.relative_to(root)))
    assert {"EPD_NATIVE_KERNELS", "EPD_STATE_DIR", "EPD_CACHE_DIR", "EPD_DEMO_PROMPT"} <= set(found)
    missing = {name: where for name, where in found.items()
               if name not in ENV_OUTSIDE_SETTINGS and nested_spelling(name.removeprefix("EPD_").lower()
                                                                         .replace("__", "_"), Settings) is None}
    assert not missing, f"EPD_* variables read outside the settings model and not in ENV_OUTSIDE_SETTINGS: {missing}"


@pytest.mark.parametrize("name, check", [
    ("EPD_MODEL", lambda s: s.model is None),  # not Path("") == "." (the current directory)
    ("EPD_REDIS__URL", lambda s: s.redis.url is None),  # a private redis-server, not a traceback later
    ("EPD_DECODE__REPLICAS", lambda s: s.decode.replicas == 1),
    ("EPD_API__ADMIN_TOKEN", lambda s: s.api.admin_token is None),
])
def test_empty_variables_count_as_unset(name, check, monkeypatch):
    monkeypatch.setenv(name, "")
    assert check(Settings.load())


def test_an_empty_unknown_variable_is_not_an_error(monkeypatch):
    monkeypatch.setenv("EPD_BOGUS", "")
    Settings.load()


@pytest.mark.parametrize("name, value, message", [
    ("EPD_DECODE", "notjson", "EPD_DECODE must hold a JSON object of decode settings"),
    ("EPD_DECODE", "notjson", "EPD_DECODE__REPLICAS="),
    ("EPD_API__API_KEYS", "k-secretsecretsecret", "EPD_API__API_KEYS must hold a JSON list, e.g. '[\"k-1\", \"k-2\"]'"),
    ("EPD_DECODE__CPU_AFFINITY", "0,1", "EPD_DECODE__CPU_AFFINITY must hold a JSON list, e.g. '[0, 1]'"),
    ("EPD_DECODE__RAY_RESOURCES", "gpu", "EPD_DECODE__RAY_RESOURCES must hold a JSON object"),
])
def test_a_variable_that_must_be_json_is_named(name, value, message, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as err:
        Settings.load()
    assert message in str(err.value) and value not in str(err.value)  # values may be secrets: never echoed


@pytest.mark.parametrize("yaml_text, message", [
    ("model: 5\n", "invalid settings: model: expected a path (a string) (from {config})"),
    ("decode: [1, 2]\n", "invalid settings: decode: expected a mapping of its settings (see `epd config schema`) "
                          "(from {config})"),
    ("decode: {replicas: 1e3}\n", "invalid settings: decode.replicas: '1e3' is not an integer (write it as digits: "
                                   "1000) (from {config})"),
    ("decode: {replica: 2}\n", "invalid settings: decode.replica: unknown setting (did you mean decode.replicas?) "
                                "(from {config})"),
    ("decode: {engine: {block_sise: 16}}\n", "decode.engine.block_sise: unknown setting (did you mean "
                                              "decode.engine.block_size?)"),
    ("decode: {replicas: -1}\n", "decode.replicas: Input should be greater than or equal to 0 (from {config})"),
])
def test_a_bad_file_value_is_named_with_the_file_and_what_would_do(yaml_text, message, tmp_path):
    config = tmp_path / "epd.yaml"
    config.write_text(yaml_text)
    with pytest.raises(SettingsError) as err:
        Settings.load(config)
    assert message.format(config=config) in str(err.value)


def test_a_bad_value_names_the_variable_that_set_it_over_the_file(monkeypatch, tmp_path):
    config = tmp_path / "epd.yaml"
    config.write_text("decode: {replicas: 2}\n")
    monkeypatch.setenv("EPD_DECODE__REPLICAS", "-1")
    with pytest.raises(SettingsError, match=r"decode.replicas: .* \(from EPD_DECODE__REPLICAS\)$"):
        Settings.load(config)
    monkeypatch.delenv("EPD_DECODE__REPLICAS")
    monkeypatch.setenv("EPD_DECODE", '{"replicaz": 1}')
    with pytest.raises(SettingsError, match=r"decode.replicaz: unknown setting \(did you mean decode.replicas\?\) "
                                            r"\(from EPD_DECODE\)$"):
        Settings.load(config)
    monkeypatch.setenv("EPD_DECODE", '{"engine": {"threads": 2}}')  # merged with the file's section
    config.write_text("decode: {replicas: -1}\n")
    with pytest.raises(SettingsError, match=rf"decode.replicas: .* \(from {re.escape(str(config))}\)$"):
        Settings.load(config)
    monkeypatch.delenv("EPD_DECODE")
    with pytest.raises(SettingsError, match=r"decode.replicas: Input should be greater than or equal to 0$"):
        Settings.load(config, {"decode": {"replicas": -1}})  # a flag's: the CLI names it


def test_whole_sections_as_json_still_load(monkeypatch):
    monkeypatch.setenv("EPD_DECODE", '{"replicas": 3}')
    monkeypatch.setenv("EPD_API__API_KEYS", '["k-0123456789abcdef"]')
    s = Settings.load()
    assert s.decode.replicas == 3 and len(s.api.api_keys) == 1


@pytest.mark.parametrize("url", ["notaurl", "http://h:6379/0", "redis://", "redis://h:port/0", "unix://",
                                 "redis://:hunter2@h:notaport/0"])
def test_redis_urls_that_redis_would_refuse_are_refused_at_load(url):
    with pytest.raises(SettingsError) as err:
        Settings.load(None, {"redis": {"url": url}})
    assert "redis.url" in str(err.value) and "hunter2" not in str(err.value)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://user:pw@h/1", "unix:///run/redis.sock",
                                 "redis://h"])
def test_redis_urls_redis_takes_are_accepted(url):
    assert Settings.load(None, {"redis": {"url": url}}).redis.url == url


@pytest.mark.parametrize("device", ["gpu9", "cuda:x", "CUDA", "meta", ""])
def test_engine_devices_are_checked_at_load(device):
    with pytest.raises(SettingsError, match="decode.engine.device: .* is not a device epd runs on"):
        Settings.load(None, {"decode": {"engine": {"device": device}}})


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "mps"])
def test_engine_devices_are_not_required_to_exist_where_the_settings_load(device):
    """The control plane may run without the GPUs its workers use (Kubernetes): only spelling is checked."""
    assert Settings.load(None, {"prefill": {"engine": {"device": device}}}).prefill.engine.device == device


@pytest.mark.parametrize("name, value", [("EPD_TRANSFER__TIMEOUT_S", "inf"),
                                         ("EPD_SCHEDULER__REQUEST_TIMEOUT_S", "nan"), ("EPD_DECODE__NUM_CPUS", "inf")])
def test_numbers_must_be_finite(monkeypatch, name, value):
    """An infinite or NaN deadline never passes: whatever it bounds would be held for good."""
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match="finite number"):
        Settings.load()


def test_a_key_given_twice_in_the_file_is_refused_with_both_lines(tmp_path):
    path = tmp_path / "epd.yaml"
    path.write_text("decode:\n  replicas: 1\n  engine: {dtype: float32}\n  replicas: 2\n")
    with pytest.raises(SettingsError, match=r"the key 'replicas' appears twice in one mapping \(lines 2 and 4\)"):
        Settings.load(path)
    path.write_text("decode: {replicas: 1}\nprefill: {replicas: 1}\ndecode: {replicas: 2}\n")
    with pytest.raises(SettingsError, match=r"'decode' appears twice .*lines 1 and 3"):
        Settings.load(path)
    # one key in each of two mappings, and a merge key's keys overridden beside it, are not duplicates
    path.write_text("prefill: &pool {replicas: 2, num_cpus: 0.5}\ndecode:\n  <<: *pool\n  replicas: 3\n")
    s = Settings.load(path)
    assert (s.prefill.replicas, s.decode.replicas, s.decode.num_cpus) == (2, 3, 0.5)


@pytest.mark.parametrize("text, message", [
    ("decode:\n  replicas: true\n", "decode: replicas takes a number, not true"),
    ("prefill:\n  num_gpus: false\n", "prefill: num_gpus takes a number, not false"),
    ("decode:\n  engine: {kv_cache_bytes: true}\n", "decode.engine: kv_cache_bytes takes a number, not true"),
    ("encode:\n  cpu_affinity: [0, true]\n", "encode: cpu_affinity takes a list of numbers, not [0, true]"),
    ("scheduler:\n  queue_timeout_s: true\n", "scheduler: queue_timeout_s takes a number, not true"),
])
def test_a_boolean_for_a_number_is_refused_by_name(tmp_path, text: str, message: str):
    """pydantic would read true as 1 (one replica, a one-byte pool, a one-second timeout)."""
    path = tmp_path / "epd.yaml"
    path.write_text(text)
    with pytest.raises(SettingsError) as info:
        Settings.load(path)
    assert message in str(info.value)


def test_numbers_and_switches_still_load_from_the_file_and_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "epd.yaml"
    path.write_text("decode: {replicas: 2, num_gpus: 0.5, cpu_affinity: [0, 1], engine: {kv_cache_bytes: null}}\n"
                    "observability: {metrics: false}\n")
    monkeypatch.setenv("EPD_PREFILL__REPLICAS", "3")
    s = Settings.load(path)
    assert (s.decode.replicas, s.decode.num_gpus, s.decode.cpu_affinity) == (2, 0.5, [0, 1])
    assert s.prefill.replicas == 3 and s.observability.metrics is False


@pytest.mark.parametrize("origin", ["chat.example.com", "https://chat.example.com/", "https://h/app", "ftp://h",
                                    "https://"])
def test_cors_origins_must_be_web_origins(origin):
    with pytest.raises(SettingsError, match=r"api.cors_allow_origins.*is not a web origin: use scheme://host\[:port\]"):
        Settings.load(None, {"api": {"cors_allow_origins": [origin]}})


def test_cors_origins_are_taken_as_given():
    origins = ["https://chat.example.com", "http://127.0.0.1:3000", "*"]
    assert Settings.load(None, {"api": {"cors_allow_origins": origins}}).api.cors_allow_origins == origins
    assert Settings.load(None, {}).api.cors_allow_origins == []

"""The settings model: precedence of its sources, validation with clear messages, the JSON schema."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from controlplane.settings import Settings, SettingsError

pytestmark = [pytest.mark.unit]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os
    for key in list(os.environ):
        if key.startswith("EPD_"):
            monkeypatch.delenv(key)


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
    ({"redis": {"prefix": "bad prefix"}}, "redis.prefix"),
    ({"decode": {"replicas": 0}}, "both have replicas"),
    ({"mode": "colocated", "prefill": {"replicas": 2}}, "colocated mode has no prefill pool"),
    ({"mode": "colocated", "encode": {"replicas": 1}}, "colocated mode has no encode pool"),
    ({"mode": "aggregated"}, "mode: Input should be 'disaggregated' or 'colocated'"),
    ({"decode": {"ray_resources": {"epd-decode": -1}}}, "ray_resources need a name and an amount >= 0"),
])
def test_bad_settings_are_refused_with_the_field_named(overrides, message):
    with pytest.raises(SettingsError) as err:
        Settings.load(None, overrides)
    assert message in str(err.value)


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


def test_secrets_are_masked_in_the_effective_settings():
    s = Settings.load(None, {"transfer": {"token": "x" * 32}, "api": {"admin_token": "y" * 20}})
    data = s.redacted()
    assert data["transfer"]["token"] == "**********" and data["api"]["admin_token"] == "**********"
    assert "x" * 32 not in json.dumps(data)
    assert s.transfer.token.get_secret_value() == "x" * 32


def test_json_schema_covers_every_section_with_constraints():
    schema = Settings.model_json_schema()
    assert set(schema["properties"]) == {"model", "mode", "encode", "prefill", "decode", "transfer", "scheduler",
                                         "api", "redis", "ray", "observability"}
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

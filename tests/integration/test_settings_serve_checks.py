"""Settings that only the model or the disk can check are refused by `epd serve` before it starts anything:
no Redis, no Ray, no replica, no admin token written; one line and exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controlplane.serve import validate
from controlplane.settings import Settings, SettingsError

from http_helpers import free_loopback_port
from kv_helpers import make_pki

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_env(no_epd_env):
    pass


def _tls(folder: Path) -> dict:
    pki = make_pki(folder, "serve-checks")
    return {"tls_ca": str(pki.ca), "tls_cert": str(pki.server_cert), "tls_key": str(pki.server_key)}


def test_good_settings_pass(default_ckpt, tmp_path):
    validate(Settings.load(None, {"transfer": {"codec_policy": "int8,0=bf16,-1=bf16", **_tls(tmp_path)}}),
             default_ckpt)
    validate(Settings.load(None, {"transfer": {"codec_policy": "auto"}}), default_ckpt)


@pytest.mark.parametrize("policy", ["int8,99=bf16", "int8,-5=bf16", "bf16,4=int8"])
def test_a_codec_policy_naming_a_layer_the_model_lacks_is_refused(policy, default_ckpt):
    with pytest.raises(SettingsError, match=r"transfer.codec_policy .* but the model has 4 layers"):
        validate(Settings.load(None, {"transfer": {"codec_policy": policy}}), default_ckpt)


@pytest.mark.parametrize("missing", ["tls_ca", "tls_cert", "tls_key"])
def test_tls_files_that_do_not_exist_are_refused_with_the_setting_named(missing, default_ckpt, tmp_path):
    tls = _tls(tmp_path) | {missing: str(tmp_path / "nowhere.pem")}
    with pytest.raises(SettingsError, match=f"transfer.{missing}: cannot read .*nowhere.pem: No such file"):
        validate(Settings.load(None, {"transfer": tls}), default_ckpt)


def test_tls_files_that_are_not_pem_are_refused(default_ckpt, tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    tls = _tls(tmp_path) | {"tls_cert": str(junk)}
    with pytest.raises(SettingsError, match="transfer.tls_ca/tls_cert/tls_key: cannot load"):
        validate(Settings.load(None, {"transfer": tls}), default_ckpt)


def _serve(env: dict[str, str], tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    state = tmp_path / "state"
    start = time.monotonic()
    port = str(free_loopback_port())
    result = subprocess.run([sys.executable, "-m", "controlplane.cli", "serve", "--port", port, *args],
                            capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "EPD_STATE_DIR": str(state),
                                 **env})
    return result, time.monotonic() - start


@pytest.mark.parametrize("env, args, message", [
    ({"EPD_TRANSFER__TLS_CA": "/nonexistent/ca.pem", "EPD_TRANSFER__TLS_CERT": "/nonexistent/c.pem",
      "EPD_TRANSFER__TLS_KEY": "/nonexistent/k.pem"}, (), "transfer.tls_ca: cannot read /nonexistent/ca.pem"),
    ({"EPD_TRANSFER__CODEC_POLICY": "int8,99=bf16"}, (), "transfer.codec_policy 'int8,99=bf16': codec policy "
                                                         "names layer 99, but the model has 4 layers"),
    ({"EPD_DECODE__ENGINE__DEVICE": "gpu9"}, (), "decode.engine.device: 'gpu9' is not a device"),
    ({}, ("--redis-url", "notaurl"), "--redis-url (redis.url): 'notaurl' is not a Redis URL"),
    ({}, ("--redis-url", "redis://127.0.0.1:1/0"), "cannot reach Redis at redis://127.0.0.1:1/0"),
])
def test_serve_refuses_before_starting_anything(env, args, message, default_ckpt, tmp_path):
    result, seconds = _serve(env, tmp_path, "--model", str(default_ckpt), *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("epd: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "state" / "admin_token").exists()  # written only after Redis is up
    assert seconds < 60

"""Bad values are refused with a message naming the field (schema first, cross-field checks in the
templates), and generated secrets never appear in the NOTES."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import yaml

from chart_tools import CPU_VALUES, control_plane_env, defaults, find, helm, refusal, render

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("args,where,why", [
    (("--set", "settings.decode.replicas=-1"), "/settings/decode/replicas", "minimum"),
    (("--set", "settings.transfer.codec_policy=int9"), "/settings/transfer/codec_policy", "pattern"),
    (("--set", "settings.transfer.codec_policy=int8\\,0=bf17"), "/settings/transfer/codec_policy", "pattern"),
    (("--set", "auth.existingSecret=mine", "--set", "auth.existingSecretKeys.adminToken="),
     "/auth/existingSecretKeys/adminToken", "minLength"),
    (("--set", "auth.existingSecret=mine", "--set", "auth.existingSecretKeys.transferToken=null"),
     "/auth/existingSecretKeys", "transferToken"),
    (("--set", "redis.auth.existingSecret=mine", "--set", "redis.auth.existingSecretKey="),
     "/redis/auth/existingSecretKey", "minLength"),
    (("--set", "redis.enabled=false", "--set", "redis.external.existingSecret=r"),
     "/redis/external/existingSecretKey", "minLength"),
    (("--set", "auth.transferToken=short"), "/auth/transferToken", "pattern"),
    (("--set", "settings.decode.engine.kv_cache_byte=1"), "/settings/decode/engine", "kv_cache_byte"),
    (("--set", "settings.api.host=0.0.0.0"), "/settings/api", "host"),
    (("--set", "pools.decode.maxReplicas=-2"), "/pools/decode/maxReplicas", "minimum"),
    # spelled into the Redis URL as it is: a '/' would end the URL's authority there
    (("--set", "redis.auth.password=pass/word-0123456789"), "/redis/auth/password", "pattern"),
    (("--set", "redis.auth.password=short"), "/redis/auth/password", "pattern"),
    (("--set", "auth.adminToken=short"), "/auth/adminToken", "pattern"),
    (("--set", "auth.opsToken=short"), "/auth/opsToken", "pattern"),
    (("--set", "settings.api.ops_token=ops-token-0123456789ab"), "/settings/api", "ops_token"),
])
def test_bad_values_are_refused_by_the_schema(args: tuple[str, ...], where: str, why: str) -> None:
    message = refusal(*args)
    assert "values don't meet the specifications of the schema" in message
    assert f"'{where}'" in message and why in message, message


@pytest.mark.parametrize("args,needle", [
    (("--set", "settings.decode.replicas=9"), "settings.decode.replicas (9) is above pools.decode.maxReplicas (8)"),
    (("--set", "settings.prefill.engine.block_size=32"), "settings.prefill.engine.block_size (32) and"),
    (("--set", "redis.enabled=false"), "set redis.external.url"),
    (("--set", "redis.enabled=false", "--set", "redis.external.url=redis://:pw@redis.example:6379/0"),
     "redis.external.url holds a password, which would be a plain env value"),
    (("--set", "redis.enabled=false", "--set", "redis.external.url=redis://u:pw@redis.example:6379/0"),
     "redis.external.url holds a password"),
    (("--set", "redis.enabled=false", "--set", "redis.external.url=redis://redis.example:6379/0?Password=pw"),
     "redis.external.url holds a password"),
    (("--set", "settings.prefill.replicas=0", "--set", "pools.prefill.minReplicas=0"),
     "settings.prefill.replicas is 0: the prefill pool needs a replica"),
    (("--set", "settings.encode.replicas=null"), "settings.encode.replicas is null"),
    (("--set", "settings.decode.num_gpus=2"), "settings.decode.num_gpus (2) is more than one decode pod offers Ray "
                                               "(1, the GPUs in its limits"),
    (("--set", "settings.encode.replicas=1", "--set", "settings.encode.num_gpus=1"),
     "settings.encode.num_gpus (1) is more than one encode pod offers Ray (0,"),
    (("--set", "settings.decode.num_cpus=9"), "settings.decode.num_cpus (9) is more than one decode pod offers Ray (8, "
                                               "from its CPU limit 8)"),
    (("-f", CPU_VALUES, "--set", "settings.decode.num_cpus=2"), "offers Ray (1, from its CPU limit 1)"),
    (("--set", "pools.decode.resources.limits.cpu=1500m", "--set", "settings.decode.num_cpus=3"),
     "offers Ray (2, from its CPU limit 1500m)"),  # KubeRay rounds the limit up
    (("--set-string", "pools.decode.rayStartParams.num-cpus=2", "--set", "settings.decode.num_cpus=3"),
     "offers Ray (2, from its rayStartParams num-cpus 2)"),
    (("--set", "pools.prefill.rayStartParams.resources=x"),
     "pools.prefill.rayStartParams.resources is set by the chart"),
    # the old docs' way to give the control plane a Ray token: the chart's own would be a second copy
    (("--set-json", 'controlPlane.extraEnv=[{"name": "RAY_AUTH_MODE", "value": "token"}]'),
     "controlPlane.extraEnv sets RAY_AUTH_MODE, which the chart sets itself while auth.rayToken.enabled is true"),
    (("--set-json", 'pools.decode.extraEnv=[{"name": "RAY_AUTH_TOKEN", "value": "x"}]'),
     "pools.decode.extraEnv sets RAY_AUTH_TOKEN"),
])
def test_cross_field_mistakes_are_refused_by_name(args: tuple[str, ...], needle: str) -> None:
    assert needle in refusal(*args)


def test_what_ray_is_told_a_pod_has_is_what_replicas_are_checked_against() -> None:
    """KubeRay starts Ray with num-cpus rounded up from the CPU limit, num-gpus from the limits' *gpu keys,
    and either from rayStartParams when given (Intel's gpu.intel.com/i915 or a MIG slice need that)."""
    assert render("--set", "pools.decode.resources.limits.cpu=1500m", "--set", "settings.decode.num_cpus=2")
    intel = ("--set", "pools.decode.resources.limits.nvidia\\.com/gpu=null",
             "--set", "pools.decode.resources.requests.nvidia\\.com/gpu=null",
             "--set", "pools.decode.resources.limits.gpu\\.intel\\.com/i915=1")
    assert "offers Ray (0," in refusal(*intel)
    assert render(*intel, "--set-string", "pools.decode.rayStartParams.num-gpus=1")


def test_the_demo_model_without_its_encode_pool_is_refused() -> None:
    """No settings.model: the pods would serve the demo model, which has a vision encoder; with no encode
    replica the control plane would never be Ready. So the chart's bare defaults are refused, saying why."""
    assert "settings.model is null" in refusal(model=False)
    assert "settings.model is null" in refusal("--set", "settings.model=null")
    assert render("-f", CPU_VALUES)  # the demo model with its encode pool
    assert render("--set", "settings.mode=colocated", "--set", "settings.model=null")  # one engine encodes too


def test_lint_refuses_a_bad_value_too() -> None:
    r = helm("lint", "--strict", "{chart}", "--set", "settings.encode.replicas=-3")
    assert r.returncode != 0 and "/settings/encode/replicas" in r.stdout + r.stderr


# ------------------------------------------------------------------ secrets and NOTES
def _install_dry_run(*args: str) -> tuple[list[dict[str, Any]], str]:
    r = helm("install", "t", "{chart}", "--namespace", "epd", "--dry-run=client", *args)
    assert r.returncode == 0, r.stderr
    manifest, notes = r.stdout.split("MANIFEST:", 1)[1].split("NOTES:", 1)
    return [d for d in yaml.safe_load_all(manifest) if d], notes


@pytest.mark.parametrize("extra", [(), ("--set", "auth.adminToken=given-admin-token-0123456789",
                                         "--set", "auth.apiKeys[0]=given-api-key-0123456789")],
                         ids=["generated", "given"])
def test_secrets_never_appear_in_notes(extra: tuple[str, ...]) -> None:
    objs, notes = _install_dry_run(*extra)
    secrets: list[str] = []
    for s in (o for o in objs if o["kind"] == "Secret"):
        for raw in s["data"].values():
            value = base64.b64decode(raw).decode()
            secrets.append(value)
            if value.startswith("["):
                secrets += json.loads(value)
    assert len(secrets) >= 4  # transfer token, admin token, the API key list and its key, redis password
    assert all(len(v) >= 16 for v in secrets)
    leaked = [v for v in secrets if v in notes or v[:12] in notes]
    assert not leaked, "NOTES print a secret"
    assert "kubectl -n epd get secret t-epd-auth" in notes  # it says where to read them instead
    if extra:
        assert "given-admin-token-0123456789" in secrets


def test_generated_secrets_are_long_and_distinct() -> None:
    secrets = {k: base64.b64decode(v).decode() for s in defaults() if s["kind"] == "Secret"
               for k, v in s["data"].items()}
    assert set(secrets) == {"transfer-token", "admin-token", "ops-token", "api-keys", "redis-password", "auth_token"}
    assert len(secrets["transfer-token"]) >= 32 and len(secrets["admin-token"]) >= 32
    assert len(secrets["ops-token"]) >= 32 and len(secrets["auth_token"]) >= 32
    keys = json.loads(secrets["api-keys"])
    assert len(keys) == 1 and len(keys[0]) >= 32
    assert len(set(secrets.values())) == 6


def test_open_api_when_asked() -> None:
    objs = render("--set", "auth.generateApiKey=false")
    assert "EPD_API__API_KEYS" not in control_plane_env(objs)
    assert "api-keys" not in find(objs, "Secret", "-auth")["data"]

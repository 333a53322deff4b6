"""What the chart does to keep a release's credentials and internals to itself: the ops token reaches the
control plane and Prometheus from the auth Secret, every epd pod runs as the image's user and can read the
mounted mTLS files, only the release's own pods reach Ray and Redis, and a credential changed in values
restarts what holds it."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from chart_tools import (
    OPTIONAL,
    POOLS,
    control_plane_env,
    defaults,
    find,
    render,
    settings_from_env,
    worker_groups,
)

pytestmark = pytest.mark.integration


def _secret(objs: list[dict[str, Any]], key: str) -> str:
    return base64.b64decode(find(objs, "Secret", "-auth")["data"][key]).decode()


def test_the_ops_token_reaches_the_control_plane_and_prometheus_from_the_auth_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    objs = render("--set", "metrics.serviceMonitor.enabled=true", "--set", "auth.opsToken=ops-token-0123456789ab")
    assert _secret(objs, "ops-token") == "ops-token-0123456789ab"
    env = control_plane_env(objs)
    assert env["EPD_API__OPS_TOKEN"] == {"secretKeyRef": {"name": "t-epd-auth", "key": "ops-token"}}
    auth = find(objs, "ServiceMonitor")["spec"]["endpoints"][0]["authorization"]
    assert auth == {"type": "Bearer", "credentials": {"name": "t-epd-auth", "key": "ops-token"}}
    settings = settings_from_env(env, monkeypatch, objs)  # the secretKeyRef resolved to a stand-in token
    assert settings.api.ops_token is not None and settings.api.ops_token.get_secret_value() == "o" * 32


def test_an_ops_token_is_generated_unless_turned_off() -> None:
    assert len(_secret(defaults(), "ops-token")) >= 32
    # an existing Secret made for an older chart has no ops token: asking for a key it lacks would stop the pod
    # (CreateContainerConfigError), so with one the token is used only when its key is named
    for off in (("--set", "auth.generateOpsToken=false"), ("--set", "auth.existingSecret=mine")):
        objs = render("--set", "metrics.serviceMonitor.enabled=true", *off)
        assert "EPD_API__OPS_TOKEN" not in control_plane_env(objs)
        assert "authorization" not in find(objs, "ServiceMonitor")["spec"]["endpoints"][0]
        assert all("ops-token" not in o.get("data", {}) for o in objs if o["kind"] == "Secret")


def test_an_existing_secret_supplies_the_ops_token_under_its_key() -> None:
    objs = render("--set", "metrics.serviceMonitor.enabled=true", "--set", "auth.existingSecret=mine",
                  "--set", "auth.existingSecretKeys.opsToken=metrics-token")
    assert control_plane_env(objs)["EPD_API__OPS_TOKEN"] == {"secretKeyRef": {"name": "mine", "key": "metrics-token"}}
    assert find(objs, "ServiceMonitor")["spec"]["endpoints"][0]["authorization"]["credentials"] == {
        "name": "mine", "key": "metrics-token"}


def _epd_pods(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    cluster = find(objs, "RayCluster")["spec"]
    return {"controlplane": find(objs, "Deployment")["spec"]["template"]["spec"],
            "head": cluster["headGroupSpec"]["template"]["spec"],
            **{pool: g["template"]["spec"] for pool, g in worker_groups(objs).items()}}


def test_every_epd_pod_runs_as_the_images_user_and_can_read_the_mtls_files() -> None:
    objs = render(*OPTIONAL)
    for name, spec in _epd_pods(objs).items():
        ctx = spec["securityContext"]
        assert (ctx["runAsUser"], ctx["fsGroup"], ctx["runAsNonRoot"]) == (1000, 1000, True), name
        mtls = [v for v in spec["volumes"] if v["name"] == "mtls"]
        if name != "head":
            # the files belong to root and the pod's fsGroup: uid 1000 reads them through the group bits
            assert mtls and mtls[0]["secret"]["defaultMode"] & 0o040, f"{name}: mTLS files unreadable by the group"
            assert not mtls[0]["secret"]["defaultMode"] & 0o004, f"{name}: mTLS key readable by anyone"


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, and matchExpressions with In / NotIn / Exists)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        have = e["key"] in labels
        if e["operator"] == "In" and not (have and labels[e["key"]] in e["values"]):
            return False
        if e["operator"] == "NotIn" and have and labels[e["key"]] in e["values"]:
            return False
        if e["operator"] == "Exists" and not have:
            return False
    return True


def test_only_the_releases_own_pods_reach_ray_and_redis() -> None:
    objs = defaults()
    policy = find(objs, "NetworkPolicy")["spec"]
    cluster = find(objs, "RayCluster")["spec"]
    redis = find(objs, "StatefulSet", "-redis")["spec"]["template"]["metadata"]["labels"]
    controlplane = find(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    guarded = {"head": cluster["headGroupSpec"]["template"]["metadata"]["labels"], "redis": redis,
               **{g["groupName"]: g["template"]["metadata"]["labels"] for g in cluster["workerGroupSpecs"]}}
    assert set(guarded) == {"head", "redis", *POOLS}
    for name, labels in guarded.items():
        assert _matches(policy["podSelector"], labels), f"the policy leaves the {name} pods open"
    assert not _matches(policy["podSelector"], controlplane), "the API's own pod must stay reachable"
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    peers = [p["podSelector"] for p in rule["from"]]
    assert "ports" not in rule  # Ray and the workers use many ports; the peers are what is limited
    for labels in (controlplane, *guarded.values()):
        assert any(_matches(p, labels) for p in peers)
    stranger = {**controlplane, "app.kubernetes.io/instance": "other-release"}
    assert not any(_matches(p, stranger) for p in peers), "another release's pods are admitted"
    assert not any(_matches(p, {"app": "anything"}) for p in peers)


def test_the_network_policy_takes_extra_peers_and_can_be_turned_off() -> None:
    peer = '[{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}}}]'
    rule = find(render("--set-json", f"networkPolicy.extraIngressFrom={peer}"), "NetworkPolicy")["spec"]["ingress"][0]
    assert rule["from"][1] == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}}}
    assert not [o for o in render("--set", "networkPolicy.enabled=false") if o["kind"] == "NetworkPolicy"]


def _checksums(objs: list[dict[str, Any]]) -> tuple[str, str]:
    cp = find(objs, "Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/credentials"]
    redis = find(objs, "StatefulSet", "-redis")["spec"]["template"]["metadata"]["annotations"]
    return cp, redis["checksum/credentials"]


def test_a_credential_changed_in_values_restarts_what_holds_it_and_generated_ones_do_not() -> None:
    assert _checksums(defaults()) == _checksums(render())  # generated secrets differ per render: no restart
    password = ("--set", "redis.auth.password=first-password-0123")
    before = _checksums(render(*password))
    after = _checksums(render("--set", "redis.auth.password=second-password-0123"))
    assert before[0] != after[0] and before[1] != after[1]
    admin = _checksums(render(*password, "--set", "auth.adminToken=admin-token-0123456789"))
    assert admin[0] != before[0] and admin[1] == before[1]  # Redis does not hold the admin token


def test_the_credentials_checksum_is_salted_by_the_release() -> None:
    """Anyone who may read a pod spec reads its annotations: the checksum is a slow hash (scrypt) salted with
    the release's full name, not a plain SHA-256 of the values, so a short password set in values cannot be
    looked up or guessed at hash speed, and two releases with the same password do not show it."""
    password = ("--set", "redis.auth.password=first-password-0123")
    one, other = _checksums(render(*password, release="one")), _checksums(render(*password, release="other"))
    assert one[0] != other[0] and one[1] != other[1]
    assert _checksums(render(*password, release="one")) == one  # stable: the same values restart nothing
    assert all(len(c) == 64 and int(c, 16) >= 0 for c in one)


def test_the_redis_password_is_on_no_command_line() -> None:
    """A process's argv is readable by anyone on the node (ps): the probe hands redis-cli the password in its
    environment (REDISCLI_AUTH), not with -a; the server reads it from its own env (Redis then rewrites its
    process title)."""
    redis = find(defaults(), "StatefulSet", "-redis")["spec"]["template"]["spec"]["containers"][0]
    probe = " ".join(redis["readinessProbe"]["exec"]["command"])
    assert 'REDISCLI_AUTH="$REDIS_PASSWORD" redis-cli ping' in probe and " -a " not in probe
    env = {e["name"]: e for e in redis["env"]}
    assert "secretKeyRef" in env["REDIS_PASSWORD"]["valueFrom"]


@pytest.mark.parametrize("url", ["redis://user@redis.example:6379/0", "redis://redis.example:6379/0?db=2",
                                 "rediss://redis.example:6380/0"])
def test_an_external_redis_url_without_a_password_is_accepted(url: str) -> None:
    env = control_plane_env(render("--set", "redis.enabled=false", "--set", f"redis.external.url={url}"))
    assert env["EPD_REDIS__URL"] == url

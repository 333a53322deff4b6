"""Ray token auth as the chart wires it: one generated token, in one Secret, reaches the Ray head, every worker
group, the autoscaler and the control plane. Against a real Ray head started with the head container's rendered
environment (the Secret resolved as the kubelet would), the control plane's rendered environment joins it
through the Ray client, and the same process without the token is refused with a message that says why."""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from chart_tools import POOLS, control_plane_env, defaults, env_of, find, group_env, helm, render
from ray_head import RayHead
from ray_head import ray_head as start_ray_head

pytestmark = pytest.mark.integration

SECRET_REF = {"secretKeyRef": {"name": "t-epd-ray-token", "key": "auth_token"}}
AUTH_ENV = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": SECRET_REF}


def _head(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def _auth_env(env: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in env.items() if k.startswith("RAY_AUTH")}


def _resolved(env: dict[str, Any], objs: list[dict[str, Any]]) -> dict[str, str]:
    """``env`` with each secretKeyRef replaced by the rendered Secret's value, as the kubelet does."""
    out = {}
    for name, value in env.items():
        if isinstance(value, dict):
            ref = value["secretKeyRef"]
            value = base64.b64decode(find(objs, "Secret", ref["name"])["data"][ref["key"]]).decode()
        out[name] = value
    return out


def test_every_ray_container_and_the_control_plane_read_one_generated_token() -> None:
    objs = render("--set", "autoscaling.enabled=true")
    assert _auth_env(control_plane_env(objs)) == AUTH_ENV
    assert _auth_env(env_of(_head(objs))) == AUTH_ENV
    assert all(_auth_env(group_env(objs, pool)) == AUTH_ENV for pool in POOLS)
    autoscaler = {e["name"]: e.get("value", e.get("valueFrom"))
                  for e in find(objs, "RayCluster")["spec"]["autoscalerOptions"]["env"]}
    assert autoscaler == AUTH_ENV
    token = _resolved({"t": SECRET_REF}, objs)["t"]
    assert len(token) >= 32 and token != _resolved({"t": SECRET_REF}, defaults())["t"]  # random per install


def test_an_existing_secret_replaces_the_generated_one_and_off_means_no_token_anywhere() -> None:
    objs = render("--set", "auth.rayToken.existingSecret=my-ray")
    assert control_plane_env(objs)["RAY_AUTH_TOKEN"] == {"secretKeyRef": {"name": "my-ray", "key": "auth_token"}}
    assert not [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-ray-token")]
    off = render("--set", "auth.rayToken.enabled=false", "--set", "autoscaling.enabled=true")
    assert not [o for o in off if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-ray-token")]
    envs = [control_plane_env(off), env_of(_head(off)), *(group_env(off, p) for p in POOLS)]
    assert not any(_auth_env(e) for e in envs)
    assert "env" not in find(off, "RayCluster")["spec"]["autoscalerOptions"]


def test_a_release_from_an_older_chart_without_the_key_gets_a_token() -> None:
    """`helm upgrade --reuse-values` keeps the old release's values, which have no auth.rayToken (null deletes
    the chart's default, so the templates see no key at all)."""
    objs = render("--set", "auth.rayToken=null")
    assert _auth_env(control_plane_env(objs)) == AUTH_ENV
    find(objs, "Secret", "-ray-token")


@pytest.mark.parametrize("extra, warned", [
    ((), False),
    (("--set", "auth.existingSecret=mine"), True),  # the GitOps set-up the docs advise, Ray token forgotten
    (("--set", "auth.existingSecret=mine", "--set", "auth.rayToken.existingSecret=my-ray"), False),
])
def test_notes_warn_when_the_other_secrets_are_yours_and_the_ray_token_is_generated(
        extra: tuple[str, ...], warned: bool) -> None:
    r = helm("install", "t", "{chart}", "--namespace", "epd", "--dry-run=client", *extra)
    assert r.returncode == 0, r.stderr
    notes = r.stdout.split("NOTES:", 1)[1]
    assert ("set auth.rayToken.existingSecret" in notes) is warned
    assert "kubectl -n epd get secret" in notes and "-o jsonpath='{.data.auth_token}'" in notes


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return render()


@pytest.fixture(scope="module")
def head(rendered: list[dict[str, Any]]) -> Iterator[RayHead]:
    """`ray start --head` with the head container's rendered Ray auth environment (tests/ray_head.py)."""
    with start_ray_head("epd-rt-", _resolved(_auth_env(env_of(_head(rendered))), rendered), num_cpus=1) as h:
        yield h


JOIN = """
import sys
import ray
from controlplane.pools.ray_runtime import RayRuntime
from controlplane.pools.status import PoolError
runtime = RayRuntime(sys.argv[1], "epd-token-test")
try:
    runtime.start()
except PoolError as exc:  # what `epd serve` prints as one line, exit 2
    print(exc)
    sys.exit(2)
print("joined", len([n for n in ray.nodes() if n["Alive"]]), ray.get(ray.put("through the head")))
runtime.stop()
"""


def _join(address: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", JOIN, address], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_the_control_planes_rendered_env_joins_the_head_and_no_token_is_refused_by_name(
        head: RayHead, rendered: list[dict[str, Any]]) -> None:
    address, base, logs = head.client, head.env, head.folder / "ray" / "session_latest" / "logs"
    cp = _resolved(_auth_env(control_plane_env(rendered)), rendered)
    ok = _join(address, {**base, **cp})
    client_logs = "".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.glob("ray_client_server*")))
    assert ok.returncode == 0 and "joined 1 through the head" in ok.stdout, ok.stdout + ok.stderr[-3000:] + client_logs

    refused = _join(address, base)  # the same process without the chart's token: the Ray client times out
    assert refused.returncode == 2, refused.stdout + refused.stderr[-3000:]
    (line,) = refused.stdout.splitlines()
    assert line.startswith(f"cannot join the Ray cluster at {address}: ")
    assert "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN" in line  # what to set...
    assert line.endswith("Here: RAY_AUTH_MODE=disabled, no RAY_AUTH_TOKEN")  # ...and what this process has

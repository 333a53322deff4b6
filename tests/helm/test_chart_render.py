"""The chart renders with the defaults, values-cpu.yaml, an external Redis and every option on; helm lint
--strict passes; every rendered object validates offline; the Grafana dashboard ConfigMap follows the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from chart_tools import (
    CHART,
    CPU_VALUES,
    EXTERNAL_REDIS,
    OPTIONAL,
    control_plane_env,
    default_objects,
    defaults,
    find,
    helm,
    render,
    settings_from_env,
    validate_objects,
    worker_groups,
)

pytestmark = pytest.mark.integration


# ------------------------------------------------------------------ lint and render
@pytest.mark.parametrize("extra", [(), ("-f", CPU_VALUES), EXTERNAL_REDIS], ids=["defaults", "cpu", "external-redis"])
def test_lint_strict(extra: tuple[str, ...]) -> None:
    r = helm("lint", "--strict", "{chart}", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 chart(s) failed" in r.stdout


@pytest.mark.parametrize("extra,kinds", [
    ((), {"RayCluster": 1, "Deployment": 1, "StatefulSet": 1, "Service": 3, "Secret": 3, "PodDisruptionBudget": 3,
          "NetworkPolicy": 1, "ConfigMap": 1}),
    (("-f", CPU_VALUES), {"RayCluster": 1, "Deployment": 1, "StatefulSet": 1, "Service": 3, "Secret": 3,
                          "PodDisruptionBudget": 3, "NetworkPolicy": 1, "ConfigMap": 1}),
    (EXTERNAL_REDIS, {"RayCluster": 1, "Deployment": 1, "Service": 1, "Secret": 2, "PodDisruptionBudget": 3,
                      "NetworkPolicy": 1, "ConfigMap": 1}),
    (OPTIONAL, {"RayCluster": 1, "Deployment": 1, "StatefulSet": 1, "Service": 3, "Ingress": 1,
                "ServiceMonitor": 1, "PodDisruptionBudget": 3, "NetworkPolicy": 1, "ConfigMap": 1}),
], ids=["defaults", "cpu", "external-redis", "all-options"])
def test_every_rendered_object_validates(extra: tuple[str, ...], kinds: dict[str, int]) -> None:
    objects = list(default_objects()) if not extra else render(*extra)
    if list((CHART / "dashboards").glob("*.json")):  # the Grafana dashboard, once the chart has one
        kinds = {**kinds, "ConfigMap": kinds["ConfigMap"] + 1}  # beside the replicas file
    assert validate_objects(objects) == kinds


def test_validators_refuse_unknown_fields() -> None:
    """The validation above can fail: an unknown field in a core object and in the RayCluster is caught."""
    objs = defaults()
    find(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["bogus"] = 1
    with pytest.raises(AssertionError, match=r"Deployment/t-epd-controlplane .*bogus"):
        validate_objects([find(objs, "Deployment")])
    worker_groups(objs)["decode"]["replicaz"] = 2
    with pytest.raises(AssertionError, match=r"RayCluster/t-epd: .*replicaz"):
        validate_objects([find(objs, "RayCluster")])


def test_external_redis_url_reaches_the_control_plane_only() -> None:
    objs = render(*EXTERNAL_REDIS)
    assert control_plane_env(objs)["EPD_REDIS__URL"] == "redis://redis.example:6379/2"
    assert not [o for o in objs if "redis" in o["metadata"]["name"]]
    secret_url = render("--set", "redis.enabled=false", "--set", "redis.external.existingSecret=r",
                        "--set", "redis.external.existingSecretKey=url")
    assert control_plane_env(secret_url)["EPD_REDIS__URL"] == {"secretKeyRef": {"name": "r", "key": "url"}}


def test_in_chart_redis_url_carries_the_password_from_its_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    objs = defaults()
    env = control_plane_env(objs)
    assert env["EPD_CHART_REDIS_PASSWORD"] == {"secretKeyRef": {"name": "t-epd-redis", "key": "redis-password"}}
    assert settings_from_env(env, monkeypatch, objs).redis.url == "redis://:pw@t-epd-redis.epd.svc:6379/0"
    redis = find(objs, "StatefulSet")["spec"]
    assert redis["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "8Gi"
    assert "$(REDIS_PASSWORD)" in redis["template"]["spec"]["containers"][0]["args"]



# ------------------------------------------------------------------ the Grafana dashboard
def test_dashboard_configmap_only_when_the_file_exists(tmp_path: Path) -> None:
    chart = tmp_path / "epd"
    shutil.copytree(CHART, chart)
    shutil.rmtree(chart / "dashboards", ignore_errors=True)
    def dashboards(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")]

    assert not dashboards(render(chart=chart))
    (chart / "dashboards").mkdir()
    board = {"title": "epd", "panels": [{"type": "timeseries", "title": "TTFT"}]}
    (chart / "dashboards" / "epd.json").write_text(json.dumps(board, indent=2))
    objs = render(chart=chart)
    cm = find(objs, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["epd.json"]) == board
    validate_objects([cm])
    assert not dashboards(render("--set", "grafana.dashboard.enabled=false", chart=chart))

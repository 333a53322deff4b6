#!/usr/bin/env python
"""Build helm/epd/values.schema.json: the settings model's JSON schema plus the chart's own values.

Why generated: the chart's ``settings:`` block *is* ``controlplane.settings.Settings`` (each leaf becomes the
EPD_* variable the model reads), so its schema must be the model's. helm then refuses a bad value
(a negative replica count, an unknown codec, a typo'd key) before anything renders, with the field's path
in the message. tests/helm regenerates the file and fails when it drifts from the model.

What changes on the way from the model:
  - ``$defs``/``$ref`` are inlined (one self-contained draft-07 document that helm 3 and 4 both read);
  - fields the chart sets itself are removed (CHART_MANAGED: the API host, secrets, Redis URL, Ray address;
    CHART_MANAGED_TOP: the replicas file);
  - ``transfer.codec_policy`` (a free string in pydantic, checked by ``parse_policy``) gets CODEC_PATTERN;
  - titles and non-standard formats (``path``, ``password``) go; descriptions and defaults stay.

Usage: python scripts/gen_values_schema.py [--check] [--output PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from controlplane.settings import Settings  # noqa: E402
from kvtransfer.codecs import available_codecs  # noqa: E402

OUTPUT = ROOT / "helm" / "epd" / "values.schema.json"
POOLS = ("encode", "prefill", "decode")

# Settings the chart derives (so values must not set them): (section, field) -> where the value comes from.
CHART_MANAGED: dict[tuple[str, str], str] = {
    ("api", "host"): "0.0.0.0 inside the control-plane pod",
    ("api", "admin_token"): "auth.adminToken / auth.existingSecret",
    ("api", "api_keys"): "auth.apiKeys / auth.existingSecret",
    ("api", "ops_token"): "auth.opsToken / auth.existingSecret",
    ("transfer", "token"): "auth.transferToken / auth.existingSecret",
    ("transfer", "tls_ca"): "auth.mtls",
    ("transfer", "tls_cert"): "auth.mtls",
    ("transfer", "tls_key"): "auth.mtls",
    ("redis", "url"): "redis.enabled / redis.external",
    ("ray", "address"): "the RayCluster's head service (Ray client)",
}
# Top-level settings the chart sets itself, likewise removed.
CHART_MANAGED_TOP: dict[str, str] = {
    "replicas_file": "the chart's replicas ConfigMap, rendered from settings.<pool>.replicas",
}


def codec_pattern(codecs: tuple[str, ...] | None = None) -> str:
    """A regex accepting what ``kvtransfer.policy.parse_policy`` accepts: a codec, optionally followed by
    LAYER=CODEC overrides ('int8,0=bf16,-1=bf16'), or 'auto' / 'auto:<budget in (0, 1)>'; plus the settings'
    own 'lossless' (``Settings.wire_codec_policy`` resolves it). Whitespace around parts and empty parts are
    allowed, as parse_policy allows them."""
    c = "(" + "|".join(codecs or available_codecs()) + ")"
    override = rf"[-+]?[0-9]+\s*=\s*{c}"
    explicit = rf"[\s,]*{c}(\s*,(\s*{override})?)*[\s,]*"
    budget = r"\+?(0*\.[0-9]*[1-9][0-9]*|[0-9]*\.?[0-9]+[eE]-[0-9]+)"
    auto = rf"auto(:\s*{budget})?"
    return rf"^\s*(lossless|{auto}|{explicit})\s*$"


_DROP_KEYS = {"title"}
_STANDARD_FORMATS = {"date-time", "date", "time", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
                     "regex", "int32", "int64"}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_inline(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        merged = {**copy.deepcopy(defs[name]), **{k: v for k, v in node.items() if k != "$ref"}}
        return _inline(merged, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS or key == "$defs" or key == "writeOnly":
            continue
        if key == "format" and value not in _STANDARD_FORMATS:
            continue
        # "properties" maps field names to schemas: recurse into the values, keep every name
        out[key] = ({k: _inline(v, defs) for k, v in value.items()} if key == "properties"
                    else _inline(value, defs))
    return out


def settings_schema() -> dict[str, Any]:
    """The ``settings:`` block: Settings' schema, inlined, minus CHART_MANAGED, with the codec pattern."""
    raw = Settings.model_json_schema()
    schema = _inline(raw, raw.get("$defs", {}))
    props = schema["properties"]
    for section, field in CHART_MANAGED:
        del props[section]["properties"][field]
    for field in CHART_MANAGED_TOP:
        del props[field]
    policy = props["transfer"]["properties"]["codec_policy"]
    policy["pattern"] = codec_pattern()
    policy["description"] = (policy.get("description", "") + "; codecs: " + ", ".join(available_codecs())
                             + "; per-layer overrides LAYER=CODEC (negative = from the end); auto or auto:<budget>")
    schema["description"] = ("epd's settings (controlplane/settings.py); each leaf becomes an EPD_* variable. "
                             "Set by the chart, so refused here: "
                             + ", ".join(f"{s}.{f}" for s, f in sorted(CHART_MANAGED)))
    schema["additionalProperties"] = False
    return schema


# ------------------------------------------------------------------ the chart's own values
def _obj(props: dict[str, Any] | None = None, required: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": props or {}}
    if required:
        out["required"] = list(required)
    out.update(extra)
    return out


def _str(description: str | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string", **extra}
    if description:
        out["description"] = description
    return out


def _int(minimum: int | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "integer", **extra}
    if minimum is not None:
        out["minimum"] = minimum
    return out


_BOOL = {"type": "boolean"}
REDIS_PASSWORD_PATTERN = r"^(|[A-Za-z0-9._~!$&'()*+,;=-]{16,})$"  # 16+ characters, as the generated tokens
_ANY_OBJ = {"type": "object"}  # a Kubernetes structure passed through (affinity, a volume source, ...)
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_QUANTITY = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "number", "minimum": 0}]}
_RESOURCES = _obj({"requests": {"type": "object", "additionalProperties": _QUANTITY},
                   "limits": {"type": "object", "additionalProperties": _QUANTITY},
                   "claims": {"type": "array"}})
_ENV = {"type": "array", "items": {"type": "object", "required": ["name"],
                                   "properties": {"name": _str(minLength=1)}}}
_TOLERATIONS = {"type": "array", "items": {"type": "object"}}
_NAME = _str(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", maxLength=253)  # a Kubernetes object name
_PROBE = _obj({k: _int(1) for k in ("periodSeconds", "failureThreshold", "timeoutSeconds", "initialDelaySeconds",
                                    "successThreshold")})


def _placement() -> dict[str, Any]:
    return {"nodeSelector": _STR_MAP, "tolerations": _TOLERATIONS, "affinity": _ANY_OBJ,
            "podAnnotations": _STR_MAP, "podLabels": _STR_MAP}


def _pool() -> dict[str, Any]:
    return _obj({
        "minReplicas": _int(0, description="fewest pods the autoscaler keeps; <= settings.<pool>.replicas"),
        "maxReplicas": _int(0, description="most pods the autoscaler (and epd scale) may use"),
        "resources": _RESOURCES, **_placement(),
        "rayStartParams": _STR_MAP, "extraEnv": _ENV, "shmSize": _QUANTITY,
        "podDisruptionBudget": _obj({"enabled": _BOOL,
                                     "maxUnavailable": {"anyOf": [_int(0), _str(pattern=r"^[0-9]+%$")]}}),
    }, required=("minReplicas", "maxReplicas"))


def _secret_ref(what: str) -> dict[str, Any]:
    """existingSecret + existingSecretKey: naming the Secret makes the key mandatory (a missing secret
    reference is refused here, not discovered as a pod stuck in CreateContainerConfigError)."""
    return {"if": {"properties": {"existingSecret": {"minLength": 1}}, "required": ["existingSecret"]},
            "then": {"required": ["existingSecretKey"],
                     "properties": {"existingSecretKey": _str(f"the key in existingSecret holding {what}",
                                                              minLength=1)}}}


def chart_schema() -> dict[str, Any]:
    """The chart's own values (everything but ``settings:``), closed against unknown keys."""
    image = _obj({"repository": _str(minLength=1), "tag": {"type": ["string", "number"]},
                  "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}, required=("repository",))
    auth_keys = _obj({**{k: _str(f"the key holding the {d}", minLength=1) for k, d in
                         (("transferToken", "KV-transfer token"), ("adminToken", "admin token"),
                          ("apiKeys", "JSON list of API keys"))},
                      "opsToken": _str("the key holding the ops token; empty = no ops token")})
    auth = _obj({
        "existingSecret": _str("a Secret you manage, holding existingSecretKeys"),
        "existingSecretKeys": auth_keys,
        "transferToken": _str("KV-transfer bearer token; empty = generated", pattern=r"^(|.{16,})$"),
        "adminToken": _str("admin token; empty = generated", pattern=r"^(|.{16,})$"),
        "apiKeys": {"type": "array", "items": _str(minLength=1)},
        "generateApiKey": _BOOL,
        "opsToken": _str("bearer token for /metrics and /dashboard; empty = generated", pattern=r"^(|.{16,})$"),
        "generateOpsToken": _BOOL,
        "rayToken": _obj({"enabled": _BOOL,
                          "existingSecret": _str("a Secret you manage, holding the Ray token under auth_token")}),
        "mtls": _obj({"secretName": _str("a Secret with ca.crt, tls.crt and tls.key"),
                      "mountPath": _str(pattern="^/")}),
    }, required=("existingSecretKeys",),
        **{"if": {"properties": {"existingSecret": {"minLength": 1}}, "required": ["existingSecret"]},
           "then": {"properties": {"existingSecretKeys": {"required": ["transferToken", "adminToken", "apiKeys"]}}}})
    redis_external = _obj({"url": _str(pattern=r"^(|rediss?://.+)$"), "existingSecret": _str(),
                           "existingSecretKey": _str()}, **_secret_ref("the Redis URL"))
    # spelled into the Redis URL as it is: only characters a URL's userinfo takes unescaped (16 or more)
    redis_auth = _obj({"password": _str("empty = generated", pattern=REDIS_PASSWORD_PATTERN), "existingSecret": _str(),
                       "existingSecretKey": _str()},
                      **_secret_ref("the Redis password"))
    redis = _obj({
        "enabled": _BOOL, "external": redis_external,
        "image": image, "auth": redis_auth,
        "persistence": _obj({"enabled": _BOOL, "size": _QUANTITY, "storageClass": _str(),
                             "accessModes": {"type": "array", "items": _str()}}),
        "resources": _RESOURCES, "nodeSelector": _STR_MAP, "tolerations": _TOLERATIONS, "affinity": _ANY_OBJ,
    })
    return {
        "nameOverride": _str(), "fullnameOverride": _str(),
        "image": image,
        "imagePullSecrets": {"type": "array", "items": _obj({"name": _NAME}, required=("name",))},
        "rayVersion": _str(pattern=r"^[0-9]+\.[0-9]+\.[0-9]+"),
        "pools": _obj({p: _pool() for p in POOLS}, required=POOLS),
        "head": _obj({"resources": _RESOURCES, **_placement(), "rayStartParams": _STR_MAP, "shmSize": _QUANTITY}),
        "autoscaling": _obj({"enabled": _BOOL, "idleTimeoutSeconds": _int(0),
                             "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]}}),
        "controlPlane": _obj({"resources": _RESOURCES, **_placement(), "extraEnv": _ENV,
                              "startupProbe": _PROBE, "livenessProbe": _PROBE, "readinessProbe": _PROBE,
                              "waitForDependencies": _BOOL}),
        "service": _obj({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                         "port": _int(1, maximum=65535), "annotations": _STR_MAP}),
        "ingress": _obj({"enabled": _BOOL, "className": _str(), "annotations": _STR_MAP,
                         "hosts": {"type": "array", "items": _obj({
                             "host": _str(), "paths": {"type": "array", "items": _obj({
                                 "path": _str(pattern="^/"),
                                 "pathType": {"enum": ["Prefix", "Exact", "ImplementationSpecific"]}},
                                 required=("path", "pathType"))}}, required=("host",))},
                         "tls": {"type": "array", "items": {"type": "object"}}}),
        "metrics": _obj({"serviceMonitor": _obj({"enabled": _BOOL, "interval": _str(pattern=r"^[0-9]+(ms|s|m|h)$"),
                                                 "scrapeTimeout": _str(pattern=r"^[0-9]+(ms|s|m|h)$"),
                                                 "labels": _STR_MAP})}),
        "grafana": _obj({"dashboard": _obj({"enabled": _BOOL, "labels": _STR_MAP, "annotations": _STR_MAP})}),
        "redis": redis,
        "auth": auth,
        "modelVolume": _obj({"volume": _ANY_OBJ, "mountPath": _str(pattern="^/")}),
        "podSecurityContext": _ANY_OBJ,
        "networkPolicy": _obj({"enabled": _BOOL, "extraIngressFrom": {"type": "array", "items": {"type": "object"}}}),
    }


def build() -> dict[str, Any]:
    props = {"settings": settings_schema(), **chart_schema()}
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$comment": "GENERATED by scripts/gen_values_schema.py from controlplane/settings.py; do not edit.",
        "title": "epd chart values",
        "type": "object",
        "additionalProperties": False,
        "required": ["settings", "pools", "auth", "redis", "image"],
        "properties": props,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Run after changing controlplane/settings.py; --check is what the test does.")
    ap.add_argument("--output", type=Path, default=OUTPUT, help=f"where to write (default: {OUTPUT.relative_to(ROOT)})")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file differs from the model")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date with controlplane/settings.py: "
                  f"run python scripts/gen_values_schema.py", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

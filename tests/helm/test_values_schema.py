"""values.schema.json is generated from the settings model (scripts/gen_values_schema.py): it must not drift,
and its codec pattern must accept exactly the policies kvtransfer.policy.parse_policy accepts."""

from __future__ import annotations

import importlib.util
import json
import re
from types import ModuleType

import pytest

from controlplane.settings import Settings
from kvtransfer.policy import PolicyError, parse_policy

from chart_tools import CHART, ROOT


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_values_schema", ROOT / "scripts" / "gen_values_schema.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _generator()


@pytest.mark.unit
def test_values_schema_matches_the_settings_model() -> None:
    on_disk = (CHART / "values.schema.json").read_text()
    assert on_disk == gen.render(), ("helm/epd/values.schema.json drifted from controlplane/settings.py: "
                                     "run .venv/bin/python scripts/gen_values_schema.py and commit the result")


@pytest.mark.unit
def test_settings_block_is_the_model_minus_what_the_chart_sets() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["settings"]
    model = Settings.model_json_schema()
    assert set(schema["properties"]) == set(model["properties"]) - set(gen.CHART_MANAGED_TOP)
    assert set(gen.CHART_MANAGED_TOP) <= set(Settings.model_fields)
    for section, field in gen.CHART_MANAGED:
        assert field in Settings.model_fields[section].annotation.model_fields, f"{section}.{field} is no setting"
        assert field not in schema["properties"][section]["properties"]
    assert schema["properties"]["decode"]["properties"]["replicas"]["minimum"] == 0
    assert schema["properties"]["decode"]["properties"]["engine"]["additionalProperties"] is False


ACCEPTED = ["bf16", "fp8", "int8", "int4", "fp32", "auto", "auto:0.05", "auto:.5", "auto:5e-2", " int8 ",
            "int8,0=bf16,-1=bf16", "int4, 0 = bf16 , -1=fp32", "int8,", ",int8", "int8,,0=bf16", "fp8,+3=int8",
            "auto: 0.2"]
REFUSED = ["", "int9", "INT8", "bf16x", "int8,0=bf17", "int8,0", "int8,a=bf16", "0=bf16", "auto:", "auto:0",
           "auto:1.5", "auto:x", "autox", "int8;0=bf16", "int8 bf16", "int8,0=bf16=int8"]


@pytest.mark.unit
@pytest.mark.parametrize("spec", ACCEPTED + REFUSED)
def test_codec_pattern_agrees_with_parse_policy(spec: str) -> None:
    pattern = json.loads((CHART / "values.schema.json").read_text())[
        "properties"]["settings"]["properties"]["transfer"]["properties"]["codec_policy"]["pattern"]
    try:
        parse_policy(spec)
        accepted = True
    except PolicyError:
        accepted = False
    assert accepted == (spec in ACCEPTED), f"the sample list is wrong about {spec!r}"
    assert bool(re.search(pattern, spec)) == accepted, f"pattern and parse_policy disagree on {spec!r}"


@pytest.mark.unit
def test_check_mode_reports_drift(tmp_path, capsys) -> None:
    stale = tmp_path / "values.schema.json"
    stale.write_text("{}\n")
    assert gen.main(["--check", "--output", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert gen.main(["--output", str(stale)]) == 0 and gen.main(["--check", "--output", str(stale)]) == 0

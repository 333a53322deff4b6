"""How settings arrive (the ``EPD_*`` environment, a YAML file) and how their errors read: the checks that run
before the settings model validates, and the one-line messages ``SettingsError`` carries. The model itself is
``controlplane.settings``; nothing here imports it (it passes itself as ``root``)."""

from __future__ import annotations

import difflib
import json
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel


class SettingsError(ValueError):
    """Settings that do not load or validate; the message names the field and the problem."""


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's context and problem with their marks, in one line ("while scanning a quoted scalar (line 2,
    column 8): found unexpected end of stream (line 5, column 1)")."""
    parts = []
    for text, mark in ((getattr(exc, "context", None), getattr(exc, "context_mark", None)),
                       (getattr(exc, "problem", None), getattr(exc, "problem_mark", None))):
        if text:
            parts.append(text if mark is None else f"{text} (line {mark.line + 1}, column {mark.column + 1})")
    return ": ".join(parts) or " ".join(str(exc).split())


def _env_settings(environ: Mapping[str, str]) -> list[str]:
    """The non-empty EPD_* variable names in ``environ`` (matched like pydantic-settings: any case)."""
    return sorted(name for name, value in environ.items() if name.upper().startswith("EPD_") and value != "")


def check_environment(environ: Mapping[str, str], root: type[BaseModel], outside: Collection[str]) -> None:
    """Refuse EPD_* variables that name no setting of ``root`` and are not among ``outside``; suggest ``__``
    where one ``_`` was meant."""
    problems = []
    for name in _env_settings(environ):
        key = name.upper().removeprefix("EPD_")
        if name.upper() in outside or key.split("__", 1)[0].lower() in root.model_fields:
            continue  # a section's unknown field is refused by the model itself, with its path
        meant = nested_spelling(key.lower(), root)
        section = next((f for f, info in root.model_fields.items()
                        if _section_model(info.annotation) is not None and key.lower().startswith(f + "_")), None)
        if meant is not None:
            hint = f" (did you mean EPD_{meant.upper()}? nested settings use a double underscore)"
        elif section is not None:
            hint = f" (nested settings use a double underscore: EPD_{section.upper()}__<FIELD>)"
        else:
            hint = ""
        problems.append(name + hint)
    if problems:
        raise SettingsError(f"unknown setting variable{'s' if len(problems) > 1 else ''}: {'; '.join(problems)}; "
                            f"settings are EPD_<FIELD> or EPD_<SECTION>__<FIELD> (see `epd config schema`)")


def nested_spelling(key: str, model: type[BaseModel]) -> str | None:
    """``decode_engine_dtype`` -> ``decode__engine__dtype`` when that is a setting of ``model``."""
    for name, info in model.model_fields.items():
        if key == name:
            return name
        sub = _section_model(info.annotation)
        if sub is not None and key.startswith(name + "_"):
            rest = nested_spelling(key[len(name):].lstrip("_"), sub)
            if rest is not None:
                return f"{name}__{rest}"
    return None


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The settings model that ``annotation`` (maybe ``X | None``) nests, if it nests one."""
    return next((a for a in (annotation, *typing.get_args(annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)), None)


def describe_env_error(exc: ValueError, environ: Mapping[str, str], root: type[BaseModel]) -> str:
    """pydantic-settings names only the top-level field whose variable did not parse as JSON; name the
    variable itself and say what it must hold. Values are never echoed (they may be secrets)."""
    text = str(exc)
    bad = []
    for name in _env_settings(environ):
        expected = _json_expected(root, name.upper().removeprefix("EPD_").lower().split("__"))
        if expected is None:
            continue
        try:
            json.loads(environ[name])
        except ValueError:
            bad.append(f"{name} must hold {expected}")
    return "invalid settings: " + ("; ".join(bad) if bad else text)


def _json_expected(root: type[BaseModel], path: list[str]) -> str | None:
    """What JSON the variable for the setting at ``path`` must hold; None where a plain string will do."""
    model = root
    for i, key in enumerate(path):
        if key not in model.model_fields:
            return None
        annotation = model.model_fields[key].annotation
        sub = _section_model(annotation)
        if sub is not None:
            model = sub
            continue
        if i != len(path) - 1:
            return None
        origins = {typing.get_origin(a): a for a in (annotation, *typing.get_args(annotation))}
        if list in origins:
            items = typing.get_args(origins[list])
            numbers = bool(items) and isinstance(items[0], type) and issubclass(items[0], (int, float))
            return "a JSON list, e.g. '[0, 1]'" if numbers else "a JSON list, e.g. '[\"k-1\", \"k-2\"]'"
        if dict in origins:
            return 'a JSON object, e.g. \'{"name": 1}\''
        return None
    first = next(iter(model.model_fields))
    return (f"a JSON object of {'.'.join(path)} settings, e.g. '{{\"{first}\": ...}}' (or set one field at a "
            f"time: EPD_{'__'.join(path).upper()}__{first.upper()}=...)")


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last silently, so a
    setting written twice would take whichever came later in the file)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *anchor": keys given beside it override its own
            continue
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        try:
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice in one mapping (lines {seen[key]} and {line}); "
                                "keep one")
        except TypeError:  # an unhashable key (a list): construct_mapping refuses it with its own message
            continue
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def check_yaml(path: Path) -> None:
    """Refuse a config file that cannot be read, is not YAML, repeats a key or does not hold a mapping."""
    try:
        data = yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader)  # noqa: S506  # a SafeLoader subclass
    except OSError as exc:
        raise SettingsError(f"cannot read the config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:  # its text spans lines: one line here, each part with where it is
        raise SettingsError(f"{path} is not valid YAML: {_yaml_problem(exc)}") from None
    if data is not None and not isinstance(data, dict):
        raise SettingsError(f"{path} must hold a mapping of settings at the top level")


def describe(exc: ValueError, root: type[BaseModel] | None = None, environ: Mapping[str, str] | None = None,
             config: Path | None = None, overrides: Mapping[str, Any] | None = None) -> str:
    """pydantic's validation errors as one line: each field's dotted path, its problem, and where the value
    came from (an ``EPD_*`` variable or the config file; a flag's is named by the CLI, which knows it)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    data = _yaml_data(config)
    lines = []
    for e in errors():
        loc = tuple(str(p) for p in e.get("loc", ()))
        where = ".".join(loc)
        problem = _problem(e, loc, root) + _source(loc, environ or {}, config, data, overrides or {})
        lines.append(f"{where}: {problem}" if loc else problem)  # (a check across fields names its own)
    return "invalid settings: " + "; ".join(lines)


def _problem(e: Mapping[str, Any], loc: tuple[str, ...], root: type[BaseModel] | None) -> str:
    kind = e.get("type")
    if kind == "extra_forbidden":
        model = _model_at(root, loc[:-1]) if loc else None
        close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1) if model and loc else []
        return "unknown setting" + (f" (did you mean {'.'.join((*loc[:-1], close[0]))}?)" if close else "")
    if kind == "path_type":
        return "expected a path (a string)"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return "expected a mapping of its settings (see `epd config schema`)"
    if kind == "int_parsing" and isinstance(e.get("input"), str):  # a number's text: not a secret
        whole = _whole_number(e["input"])  # YAML reads 1e3 as text, not a number
        return f"{e['input'][:40]!r} is not an integer" + (f" (write it as digits: {whole})" if whole else "")
    return str(e.get("msg", "invalid")).removeprefix("Value error, ")


def _whole_number(text: str) -> int | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() and abs(value) < 1e18 else None


def _model_at(root: type[BaseModel] | None, path: tuple[str, ...]) -> type[BaseModel] | None:
    model = root
    for key in path:
        if model is None or key not in model.model_fields:
            return None
        model = _section_model(model.model_fields[key].annotation)
    return model


def _source(loc: tuple[str, ...], environ: Mapping[str, str], config: Path | None, data: Any,
            overrides: Mapping[str, Any]) -> str:
    """" (from EPD_X)" or " (from FILE)": the place that set ``loc`` or the section holding it, in the order
    the settings take them (flags, then the environment, then the file); "" for a flag or a default."""
    for where in (loc, loc[:-1]):  # (a union's error adds the member type it tried to the path)
        if not where:
            continue
        if _holds(overrides, where):
            return ""
        names = {name.upper(): name for name in _env_settings(environ)}
        for k in range(len(where), 0, -1):
            name = names.get("EPD_" + "__".join(where[:k]).upper())
            if name is None:
                continue
            if k == len(where):
                return f" (from {name})"
            try:  # a section given whole: only if its JSON holds the field (the file may hold the rest)
                if _holds(json.loads(environ[name]), where[k:]):
                    return f" (from {name})"
            except ValueError:
                pass
        if config is not None and _holds(data, where):
            return f" (from {config})"
    return ""


def _holds(data: Any, loc: tuple[str, ...]) -> bool:
    for key in loc:
        if not isinstance(data, Mapping) or key not in data:
            return False
        data = data[key]
    return bool(loc)


def _yaml_data(config: Path | None) -> Any:
    if config is None:
        return None
    try:
        return yaml.load(Path(config).read_text(), Loader=_UniqueKeyLoader)  # noqa: S506  # a SafeLoader subclass
    except (OSError, UnicodeDecodeError, yaml.YAMLError):  # check_yaml refused these before validation
        return None

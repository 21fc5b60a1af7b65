"""How a config's text becomes values: the YAML reader of config files, and the typing of each value by its field's
declared type (:mod:`empo2.config` describes the rules a user sees)."""

from __future__ import annotations

import inspect
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from empo2.config.bounds_check import MAX_CONFIG_BYTES, ConfigError, check_size, shown


def read_yaml(p: Path) -> dict[str, Any]:
    """One config file's mapping (its plain scalars kept as text), or one line saying why it is not one."""
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{p} is {p.stat().st_size:,} bytes; a config file is at most {MAX_CONFIG_BYTES:,}")
    try:
        data = yaml.load(p.read_text(), Loader=_ConfigLoader) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"malformed YAML in {p}: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _yaml_problem(exc: Exception) -> str:
    """A YAML parser error as one line: what went wrong, and where (the parser's own text spans several lines)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return " ".join(str(getattr(exc, "problem", None) or exc).split()) + where


class _ConfigLoader(yaml.SafeLoader):
    """YAML for configs: a plain scalar stays text (typed later by its field; only ``null``/``~``/empty mean unset),
    and aliases are refused, so a few bytes cannot expand into gigabytes."""

    yaml_implicit_resolvers: dict = {}
    max_depth = 64
    """Deeper nesting is refused: composing it recurses once per level, and Python's stack ends near 1,000."""
    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.MarkedYAMLError(problem=f"YAML aliases (*{event.anchor[:40]}) are not accepted in a config",
                                       problem_mark=event.start_mark)
        if self._depth >= self.max_depth:
            raise yaml.MarkedYAMLError(problem=f"lists or mappings nested deeper than {self.max_depth} levels are "
                                       "not accepted in a config", problem_mark=self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"),
                                    ["~", "n", "N", ""])
_TRUE, _FALSE = ("true", "yes", "on"), ("false", "no", "off")
_INT = re.compile(r"^[+-]?[0-9]+$")


def coerce(key: str, value: Any, obj: Any, name: str) -> Any:
    """Type a value by the field's declared annotation; text (an override, a plain YAML scalar) is parsed for it. The
    annotation is read as written (``float``, ``int | None``), whether or not its module postpones annotations."""
    annotation = {f.name: f.type for f in fields(obj)}[name]
    hint = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    check_size(key, value)
    if isinstance(value, str) and "None" in hint and value.strip() in ("", "null", "~"):
        value = None
    if value is None:
        if "None" in hint:
            return None
        raise ConfigError(f"{key} may not be empty")
    for prefix, parse in _PARSERS:
        if hint.startswith(prefix):
            return parse(key, value)
    return value


def _names(key: str, value: Any) -> list[str]:
    """A list of names from a list, or from override text ``[a, b]`` / ``a,b``."""
    if isinstance(value, str):
        text = value.strip()
        text = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        value = [v.strip().strip("'\"") for v in text.split(",") if v.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key} must be a list of names, got {shown(value)}")
    return value


def as_bool(key: str, value: Any) -> bool:
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{key} must be true or false, got {shown(value)}")


def _int(key: str, value: Any) -> int:
    if isinstance(value, str) and _INT.match(value.strip()):
        return int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {shown(value)}")
    return value


def _float(key: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ConfigError(f"{key} must be a number, got {shown(value)}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {shown(value)}")
    return float(value)


def _text(key: str, value: Any) -> str:
    if isinstance(value, (dict, list)):
        raise ConfigError(f"{key} must be a string, got {shown(value)}")
    return str(value)


def _mapping_of_ints(key: str, value: Any) -> dict[str, int]:
    """``{task: N}`` from a mapping, or from override text such as ``{chemistry-mix: 90}``."""
    if isinstance(value, str):
        try:
            value = yaml.load(value, Loader=_ConfigLoader)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{key} must be a mapping like {{task: 30}}: {_yaml_problem(exc)}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a mapping like {{task: 30}}, got {shown(value)}")
    out = {}
    for k, v in value.items():
        if isinstance(v, str) and _INT.match(v.strip()):
            v = int(v)
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{key} must map task names to integers, got {shown(k)}: {shown(v)}")
        out[k] = v
    return out


def _table_of_ints(key: str, value: Any) -> dict[str, dict[str, int]]:
    """``{name: {name: N}}`` from a mapping of mappings, or from override text such as ``{coin: {numLocations: 5}}``."""
    like = f"{key} must be a mapping like {{coin: {{numLocations: 5}}}}"
    if isinstance(value, str):
        try:
            value = yaml.load(value, Loader=_ConfigLoader)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{like}: {_yaml_problem(exc)}") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) or v is None for v in value.values()):
        raise ConfigError(f"{like}, got {shown(value)}")
    out: dict[str, dict[str, int]] = {}
    for outer, inner in value.items():
        out[str(outer)] = {}
        for name, number in (inner or {}).items():
            if isinstance(number, str) and _INT.match(number.strip()):
                number = int(number)
            if not isinstance(name, str) or isinstance(number, bool) or not isinstance(number, int):
                raise ConfigError(f"{key}.{outer} must map names to integers, got {shown(name)}: {shown(number)}")
            out[str(outer)][name] = number
    return out


_PARSERS = (("list", _names), ("dict[str, dict", _table_of_ints), ("dict", _mapping_of_ints), ("bool", as_bool), ("int", _int), ("float", _float),
            ("str", _text), ("Literal", _text))
"""How a field's value is read, by the start of its annotation."""

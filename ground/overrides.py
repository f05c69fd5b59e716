"""Config files plus ``--set section.key=value`` overrides, validated by a pydantic model: one
implementation for every CLI that takes a config (``python -m train``, ``python -m serve``,
``python -m cluster.plan``), so an override parses, merges and fails the same way everywhere.

Imports only PyYAML and pydantic: the serving and planning CLIs use it without importing torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config file, override or value that cannot be used; the message names the key."""


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that YAML 1.1's base-60 numbers stay the text they are: ``3:5`` would read
    as 185, and a step window like ``profile.steps=3:5`` must reach the config as written. (YAML 1.2, which
    every other YAML reader follows, dropped base 60.)"""


def _number_unless_base_60(loader: ConfigLoader, node: yaml.ScalarNode) -> Any:
    text = loader.construct_scalar(node)
    if ":" in text:
        return text
    if node.tag.endswith(":int"):
        return yaml.SafeLoader.construct_yaml_int(loader, node)
    return yaml.SafeLoader.construct_yaml_float(loader, node)


ConfigLoader.add_constructor("tag:yaml.org,2002:int", _number_unless_base_60)
ConfigLoader.add_constructor("tag:yaml.org,2002:float", _number_unless_base_60)


def load_yaml(text: str) -> Any:
    """YAML text as configs read it (``ConfigLoader``)."""
    return yaml.load(text, Loader=ConfigLoader)  # a SafeLoader: no arbitrary objects


def add_set_option(parser: argparse.ArgumentParser, what: str, example: str) -> None:
    """Every CLI's ``--set KEY=VALUE`` (repeatable; ``parse_set`` reads what it collects): override any ``what``,
    e.g. ``example``."""
    help_text = f"override any {what}, e.g. {example} (repeatable)"
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=help_text)


def parse_set(items: Iterable[str]) -> dict[str, Any]:
    """``["optimizer.lr=3e-4", "parallel.compile=true"]`` -> ``{"optimizer.lr": "3e-4", ...}``.

    Values are read as YAML, like the file they override: ``true``, ``8``, ``null``, ``[1, 2]`` are
    a bool, an int, None and a list. PyYAML reads ``3e-4`` (no dot) as a string; the pydantic model
    turns it into the float it obviously is.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = load_yaml(value)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {key}: cannot parse {value!r} ({exc})") from exc
    return out


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Set each dotted key (``"checkpoint.interval_steps"``) in the nested dict ``data``, in place."""
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted}: {key} is not a section")
        node[leaf] = value
    return data


def dotted_keys(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``, the keys ``apply_overrides`` takes (an empty mapping stays a value).
    Merged as overrides, a nested section changes its base key by key, not section by section (the job spec's
    ``train: {optimizer: {lr: …}}`` keeps the base file's other optimizer keys); flat, a config is MLflow's params."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping) and value:
            flat |= dotted_keys(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def read_yaml(path: str | Path | None) -> dict[str, Any]:
    """A YAML mapping (an empty file or no path: ``{}``)."""
    if path is None:
        return {}
    try:
        loaded = load_yaml(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
    return loaded or {}


def validation_problems(error: ValidationError) -> list[str]:
    """One ``section.key: message`` line per problem pydantic found."""
    lines = []
    for err in error.errors():
        where = ".".join(str(part) for part in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            message = "unknown key"
        elif "input" in err and not isinstance(err["input"], dict):
            message += f" (got {err['input']!r})"
        lines.append(f"{where}: {message}" if where else message)
    return lines


def build(model: type[M], data: dict[str, Any], source: str = "config") -> M:
    """Validate ``data`` into ``model``; a ``ConfigError`` listing every problem otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = validation_problems(exc)
        raise ConfigError(f"{source}: " + "; ".join(problems)) from exc


def load(
    model: type[M], path: str | Path | None = None, overrides: Mapping[str, Any] | None = None, source: str = ""
) -> M:
    """YAML file (optional) + dotted overrides -> a validated ``model``."""
    data = apply_overrides(read_yaml(path), overrides or {})
    return build(model, data, source or (str(path) if path is not None else "config"))

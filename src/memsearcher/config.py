"""Configs from YAML: the loader every frozen-dataclass config goes through, and the checks
their ``__post_init__`` share.

A preset file (``configs/*.yaml``) gives the values that differ from the defaults; command-line
overrides ``key=value`` (dotted for nested sections, e.g. ``optim.lr=1e-5``) apply on top.
Unknown keys and ill-typed values are errors that list what is valid. A check that fails in a
``__post_init__`` raises a ValueError that starts with the field's name, and the loader adds
the section, so the message names the dotted key (``optim.lr must be ...``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from memsearcher.errors import MemSearcherError

__all__ = [
    "changed_keys",
    "config_to_dict",
    "count",
    "finite",
    "load_config",
    "positive",
    "require",
]

C = TypeVar("C")


def finite(value: float) -> bool:
    """Whether ``value`` is a real number, neither NaN nor infinite (a bool is not one)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def require(config: Any, name: str, ok: bool, rule: str) -> None:
    """A ValueError naming the field; `load_config` adds its section (``optim.lr``)."""
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {getattr(config, name)!r}")


def count(config: Any, name: str, high: int, low: int = 1) -> None:
    """Refuse a field that is not an integer in [low, high]: a float (``1e30``) is no count,
    and a count past ``high`` cannot work on any machine."""
    value = getattr(config, name)
    ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    require(config, name, ok, f"an integer in [{low}, {high}]")


def positive(config: Any, *names: str) -> None:
    """Refuse any of the fields ``names`` below 1."""
    for name in names:
        if getattr(config, name) < 1:
            raise MemSearcherError(f"{name} must be >= 1, got {getattr(config, name)}")


def load_config(cls: type[C], path: str | Path | None, overrides: Sequence[str] = ()) -> C:
    """``cls`` from a YAML preset (or the defaults), then ``key=value`` overrides on top."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except OSError as error:
            raise MemSearcherError(f"cannot read config {path}: {error.strerror}") from None
        except yaml.YAMLError as error:
            raise MemSearcherError(f"{path}: not valid YAML: {error}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise MemSearcherError(f"{path}: the config must be a mapping")
        data = loaded or {}
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise MemSearcherError(f"override {override!r} is not key=value")
        *parents, leaf = key.strip().split(".")
        node = data
        for parent in parents:
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):
                raise MemSearcherError(f"override {override!r}: {parent} is not a section")
        node[leaf] = yaml.safe_load(text) if text.strip() else ""
    return _build(cls, data, "")


def _build(cls: type[C], data: dict[str, Any], prefix: str) -> C:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise MemSearcherError(
            f"unknown config key {prefix}{unknown[0]}; valid keys: "
            + ", ".join(prefix + name for name in names)
        )
    values = {name: _coerce(hints[name], data[name], prefix + name) for name in data}
    try:
        return cls(**values)
    except (ValueError, TypeError) as error:  # messages start with the field's name
        raise MemSearcherError(f"invalid config: {prefix}{error}") from None


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise MemSearcherError(f"{key} must be a section of keys, got {value!r}")
        return _build(hint, value, key + ".")  # type: ignore[arg-type]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    if origin is dict and not isinstance(value, dict):
        raise MemSearcherError(f"{key} must be a mapping, got {value!r}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise MemSearcherError(f"{key} must be a list, got {value!r}")
        items = args[:1] * len(value) if args[-1:] == (Ellipsis,) else args
        if len(items) != len(value):
            raise MemSearcherError(f"{key} must have {len(items)} items, got {value!r}")
        return tuple(_coerce(h, v, key) for h, v in zip(items, value, strict=True))
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML reads 1e-6 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint in (int, str, bool, float) and not (
        isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    ):
        raise MemSearcherError(f"{key} must be {hint.__name__}, got {value!r}")
    return value


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config as plain data (tuples become lists), for logs and checkpoints."""
    plain: dict[str, Any] = _plain(dataclasses.asdict(config))
    return plain


def default_dict(cls: type) -> dict[str, Any]:
    """A config class's defaults as plain data, field by field (a class may refuse its
    defaults taken together: the recipe needs its steps set): what `changed_keys` reads for a
    key that a run made before the key existed did not save."""
    defaults = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        defaults[f.name] = _plain(value)
    return defaults


def changed_keys(
    saved: Mapping[str, Any], current: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> list[str]:
    """The keys, dotted for sections (``optim.lr``), whose values differ between two configs
    or settings as plain data: what a resumed run compares with the run it continues.

    With ``defaults`` (the config class's defaults as plain data), a key the saved config
    lacks (it was written before the key existed) counts as its default, as the run then
    behaved."""
    defaults = defaults or {}
    changed = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key, defaults.get(key)), current.get(key)
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            inner_defaults = defaults.get(key)
            inner = changed_keys(
                old, new, inner_defaults if isinstance(inner_defaults, Mapping) else None
            )
            changed += [f"{key}.{name}" for name in inner]
        elif old != new:
            changed.append(key)
    return changed


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value

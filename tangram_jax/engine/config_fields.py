"""`EngineConfig`'s field declarations: `_field(default, check, help)` and the checks a field
is declared with. A check validates and normalises a value (numpy scalars become Python
numbers) or raises `EngineConfigError` naming the field, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from tangram_jax.compression.profile import BudgetProfile
from tangram_jax.sampling import is_int


class EngineConfigError(ValueError):
    """A field of `EngineConfig` with a value it cannot take; the message names both."""


# ----- field checks: each returns the normalised value or raises naming field and value ------

def _int_at_least(lo: int, *, optional: bool = False) -> Callable[[str, Any], Any]:
    def check(name, value):
        if value is None and optional:
            return None
        if not is_int(value) or value < lo:
            allowed = f"an int >= {lo}" + (" or None" if optional else "")
            raise EngineConfigError(f"{name} must be {allowed}, got {value!r}")
        return int(value)
    return check


def _fraction(name, value):
    if (not is_int(value) and not isinstance(value, (float, np.floating))) \
            or not 0 < float(value) <= 1:
        raise EngineConfigError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


def _choice(choices: tuple, *, optional: bool = False) -> Callable[[str, Any], Any]:
    def check(name, value):
        if value is None and optional:
            return None
        if not isinstance(value, str) or value not in choices:
            allowed = ", ".join(map(repr, choices)) + (" or None" if optional else "")
            raise EngineConfigError(f"{name} must be one of {allowed}, got {value!r}")
        return value
    return check


def _flag(*, optional: bool = False) -> Callable[[str, Any], Any]:
    def check(name, value):
        if value is None and optional:
            return None
        if not isinstance(value, (bool, np.bool_)):
            allowed = "True or False" + (" or None" if optional else "")
            raise EngineConfigError(f"{name} must be {allowed}, got {value!r}")
        return bool(value)
    return check


def _path_or(allowed: str, *objects: type) -> Callable[[str, Any], Any]:
    """None, an instance of `objects`, or a non-empty path string."""
    def check(name, value):
        if value is None or isinstance(value, objects):
            return value
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            raise EngineConfigError(f"{name} must be {allowed}, got {value!r}")
        return value
    return check


def _cache_folder(name, value):
    """None, or a folder path ('' and 'off' turn the cache off: `engine/compile_cache.py`)."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise EngineConfigError(f"{name} must be a folder path, '' / 'off' or None, got "
                                f"{value!r}")
    return value


def _model(name, value):
    """A model name or path (`_path_or`), or a callable that builds a `LoadedModel` (models made
    in memory, e.g. the benchmarks' random 8B shape: called when the engine loads its model,
    after the allocator is set up; a `registry.ModelSource` also says the model's config
    first, so the engine compiles while it loads)."""
    if callable(value):
        return value
    return _path_or("None (the embedded model), a model name, a Hugging Face folder, a .gguf "
                    "path or a callable returning a LoadedModel")(name, value)
_profile = _path_or("a BudgetProfile, a profile file path or None", BudgetProfile)


def _generation_config(name, value):
    """'auto', 'vllm' or a folder path (its generation_config.json is read when the engine
    loads its model)."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise EngineConfigError(f"{name} must be 'auto', 'vllm' or a folder holding a "
                                f"generation_config.json, got {value!r}")
    return value


def _chat_template(name, value):
    """None, or a Jinja file path or template text (read when the engine loads its model)."""
    if value is not None and (not isinstance(value, (str, os.PathLike)) or not os.fspath(value)):
        raise EngineConfigError(f"{name} must be None, a Jinja file path or a Jinja template, "
                                f"got {value!r}")
    return value


def _buckets(name, value):
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise EngineConfigError(f"{name} must be a non-empty sequence of positive ints, got "
                                f"{value!r}")
    values = list(value)
    if not values or any(not is_int(b) or b < 1 for b in values):
        raise EngineConfigError(f"{name} must be a non-empty sequence of positive ints, got "
                                f"{value!r}")
    return tuple(sorted({int(b) for b in values}))


def _tier_turn(name, value):
    """None, or (prompt tokens >= 1, answer tokens >= 0)."""
    if value is None:
        return None
    values = None if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) \
        else list(value)
    if values is None or len(values) != 2 or not all(is_int(x) for x in values) or \
            values[0] < 1 or values[1] < 0:
        raise EngineConfigError(f"{name} must be (prompt tokens >= 1, answer tokens >= 0) or "
                                f"None, got {value!r}")
    return int(values[0]), int(values[1])


def _host_port(name, value):
    """None, or "host:port" (a coordinator's address)."""
    if value is None:
        return None
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EngineConfigError(f"{name} must be 'host:port' (port 1-65535) or None, got "
                                f"{value!r}")
    return value


def _field(default, check: Callable[[str, Any], Any], help: str, *, cli: bool = True):
    """A config field: its default, the check that validates it, its CLI help (`cli=False`: no
    flag, e.g. a field that takes objects)."""
    return dataclasses.field(default=default, metadata={"check": check, "help": help, "cli": cli})

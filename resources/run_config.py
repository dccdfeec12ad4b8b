"""Dagster run config from the core's dataclass configs: fields, types, defaults and descriptions are
written once, in the core, and read from there.

``config_from(EvalConfig)`` is a Dagster ``Config`` class with EvalConfig's fields (a nested
dataclass becomes a nested Config, a tuple a list); ``.to_core()`` builds the dataclass back.
``config_from(GRPOConfig, overrides=True)`` has every field optional and None by default: the
fields a run sets on top of a profile, read with ``.set_fields()`` (a nested config keeps only its
set fields, so it merges into the profile's). A field's description is its
``field(metadata={"description": ...})``, else the comment that ends its line in the dataclass.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import re
import types
import typing
from typing import Any, ClassVar, Optional, Union

from dagster import Config, PermissiveConfig
from pydantic import Field, create_model

_SCALARS = (int, float, str, bool, list, dict, Any)
_FIELD_COMMENT = re.compile(r"^\s*(\w+)\s*:[^#]*#\s*(.+?)\s*$")


class CoreConfig(Config):
    """A Dagster Config mirroring the fields of a core dataclass (``core_class``)."""

    core_class: ClassVar[type]
    all_optional: ClassVar[bool] = False

    def to_core(self):
        """The core dataclass built from this config's fields (excluded fields keep the core's defaults)."""
        hints = typing.get_type_hints(self.core_class)
        values = {}
        for f in dataclasses.fields(self.core_class):
            if f.name in type(self).model_fields:
                value = getattr(self, f.name)
                if value is None and self.all_optional:
                    continue
                values[f.name] = _core_value(value, hints[f.name])
        return self.core_class(**values)

    def set_fields(self) -> dict[str, Any]:
        """The fields given a value (not None), as plain values; nested configs as dicts of their set fields."""
        return self.model_dump(exclude_none=True)


@functools.cache
def config_from(core: type, exclude: tuple[str, ...] = (), overrides: bool = False) -> type[CoreConfig]:
    """A :class:`CoreConfig` class with the init fields of the dataclass ``core`` but ``exclude``.

    ``overrides``: every field is Optional with default None ("not set"), nested ones too.
    """
    hints = typing.get_type_hints(core)
    comments = _field_comments(core)
    fields = {}
    for f in dataclasses.fields(core):
        annotation = _config_type(hints[f.name], overrides)
        if f.name in exclude or not f.init or annotation is None:  # None: not expressible as run config (a callback)
            continue
        description = f.metadata.get("description") or comments.get(f.name)
        if overrides:
            fields[f.name] = (Optional[annotation], Field(default=None, description=description))
        else:
            fields[f.name] = (annotation, _default(f, annotation, description))
    name = f"{core.__name__}{'Overrides' if overrides else 'Fields'}"
    model = create_model(name, __base__=CoreConfig, __doc__=inspect.getdoc(core), **fields)
    model.core_class, model.all_optional = core, overrides
    return model


class EnvironmentConfig(PermissiveConfig):
    """The environment a policy rolls out in, part of its protocol and lineage: ``name`` and the
    environment's options beside it, e.g. ``{name: calculator, max_calls: 8}``."""

    name: str = Field(default="single_turn", description="'single_turn' (no tools), 'calculator' (GSM8k's <<48/2=24>> annotations) or 'python' (code)")

    def spec(self) -> dict[str, Any]:
        """``{"name", "options"}``: the lineage form (``rlvr.policy.environment_spec``)."""
        options = self.model_dump(exclude={"name"})
        return {"name": self.name, "options": options}


def build_environment(spec: dict[str, Any], where: str) -> Any:
    """The environment of a spec (``{"name", "options"}``), built by ``rlvr.environments.make_environment``;
    a ValueError naming ``where`` and what was wrong (unknown environment, unknown or bad option)."""
    from rlvr.environments import make_environment

    try:
        return make_environment(spec["name"], **spec["options"])
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{where}: environment {spec['name']!r} with options {spec['options']}: {err}") from None


def _config_type(hint: Any, overrides: bool) -> Any:
    """The Dagster-config type of a dataclass field type (dataclasses nest, tuples become lists), or
    None when run config cannot hold it (callables, other objects, unions of several types)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        inner = _config_type(present[0], overrides) if len(present) == 1 else None
        return None if inner is None else Optional[inner] if len(present) < len(args) else inner
    if dataclasses.is_dataclass(hint):
        return config_from(hint, overrides=overrides)
    if origin in (tuple, list):
        inner = _config_type(args[0], overrides) if args else Any
        return None if inner is None else list[inner]
    if origin is dict:
        inner = _config_type(args[1], overrides) if args else Any
        return None if inner is None or (args and args[0] is not str) else dict[str, inner]
    return hint if hint in _SCALARS else None


def _default(f: dataclasses.Field, annotation: Any, description: str | None):
    """The pydantic Field of a dataclass field: its default, a fresh copy of a mutable one, or its factory."""
    if f.default is not dataclasses.MISSING:
        value = f.default
        if dataclasses.is_dataclass(value):
            return Field(default_factory=lambda: _config_value(value, annotation), description=description)
        if isinstance(value, (list, dict, set, tuple)):
            plain = _config_value(value)
            return Field(default_factory=lambda: copy.deepcopy(plain), description=description)
        return Field(default=value, description=description)
    if f.default_factory is not dataclasses.MISSING:
        factory = f.default_factory
        return Field(default_factory=lambda: _config_value(factory(), annotation), description=description)
    return Field(description=description)


def _config_value(value: Any, annotation: Any = None) -> Any:
    """A core value as config holds it: dataclasses as their Config (or dicts), tuples as lists."""
    if dataclasses.is_dataclass(value):
        plain = {f.name: _config_value(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        config = annotation if isinstance(annotation, type) and issubclass(annotation, CoreConfig) else None
        return config(**plain) if config is not None else plain
    if isinstance(value, (list, tuple)):
        return [_config_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _config_value(v) for k, v in value.items()}
    return value


def _core_value(value: Any, hint: Any) -> Any:
    """A config value as the core dataclass takes it: nested configs built, lists of tuple fields as tuples."""
    if isinstance(value, CoreConfig):
        return value.to_core()
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        present = [a for a in typing.get_args(hint) if a is not type(None)]
        origin = typing.get_origin(present[0]) if len(present) == 1 else None
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    return copy.deepcopy(value)


def _field_comments(core: type) -> dict[str, str]:
    """``name: type = default  # comment`` lines of the class body: field name -> comment."""
    try:
        source = inspect.getsource(core)
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(core)}
    comments: dict[str, str] = {}
    for line in source.splitlines()[1:]:
        found = _FIELD_COMMENT.match(line)
        if found and found.group(1) in names:
            comments.setdefault(found.group(1), found.group(2))
    return comments

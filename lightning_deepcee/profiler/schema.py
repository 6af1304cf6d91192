"""Check a YAML/JSON document against a dataclass with omegaconf; errors name file, key and type.

:func:`load_structured` takes a plain mapping (what ``yaml.safe_load`` or ``json.loads``
returns), checks it against a dataclass and builds that dataclass. Every problem is one
``ValueError`` saying where, what was expected, what came and the fix::

    configs/lab/cee6.yaml: devices[2].cpu: expected float, got str 'fast'; write a number

Omegaconf (a structured config made from the dataclass) checks required keys, numbers and
booleans (``1.5`` is no int) and the entries of lists of them. Around it, the loader

- refuses unknown keys, listing the allowed ones;
- never converts text and numbers into each other (omegaconf would read ``cpu: "0.2"`` as 0.2
  and ``host: 1e5`` as the text ``"100000.0"``) and keeps text literal (no ``${...}``);
- loads nested dataclasses (``list[S]``, ``tuple[S, ...]``, ``dict[str, S]``) item by item, so
  an error carries the whole key (``devices[2].cpu``; omegaconf alone says ``cpu``);
- hands ``passthrough`` fields to the dataclass unconverted: long numeric arrays that the
  dataclass checks itself (omegaconf would build one slow node per number);
- prefixes a ``ValueError`` of the dataclass's ``__post_init__`` (a check no type can express:
  a range, a shape) with the same ``<source>: <key>``.

Works with omegaconf 2.3 and later. Pure: the standard library, omegaconf and pyyaml.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

__all__ = ["describe_type", "load_structured", "read_yaml"]

_T = TypeVar("_T")
_KEY = re.compile(r"^(?P<name>[^.\[]+)(?P<indices>(?:\[\d+\])*)$")


def read_yaml(path: str | os.PathLike[str], loader: type[yaml.SafeLoader] = yaml.SafeLoader) -> Any:
    """Parse the YAML file at ``path``; a syntax error becomes a ``ValueError`` naming the file.

    ``FileNotFoundError`` is left to the caller, which knows what kind of file was missing.
    """
    text = Path(path).read_text(encoding="utf-8")
    try:
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).replace("\n", " ")
        context = getattr(err, "context", None)
        detail = f"{problem} ({context})" if context else problem
        raise ValueError(f"{path}: not valid YAML{where}: {detail}; fix the syntax there") from None


def load_structured(
    schema: type[_T],
    data: object,
    *,
    source: str = "",
    key: str = "",
    passthrough: Collection[str] = (),
    unknown_key_hint: Callable[[str], str | None] | None = None,
) -> _T:
    """Check ``data`` against the dataclass ``schema`` and build it.

    ``source`` (a file name) starts every error message; ``key`` is where ``data`` sits in that
    file (``"trace[3]"``), empty for the whole file. ``passthrough`` names fields (in ``schema``
    or any nested schema) given to the dataclass as they are. ``unknown_key_hint(key)`` may
    return the message for an unknown key (e.g. why that setting does not exist) instead of the
    list of allowed keys.
    """
    return _Loader(source, frozenset(passthrough), unknown_key_hint).load(schema, data, key)


def describe_type(hint: Any) -> str:
    """A type annotation as a user reads it: ``float``, ``list[str]``, ``float or null``."""
    if hint is type(None):
        return "null"
    if _is_union(hint):
        return " or ".join(describe_type(arg) for arg in typing.get_args(hint))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint.__name__
    item = _item_type(hint)
    if item is not None:
        return f"list[{describe_type(item)}]"
    origin = typing.get_origin(hint)
    if origin in (dict, Mapping):
        args = typing.get_args(hint)
        return f"mapping of str to {describe_type(args[1])}" if args else "mapping"
    if hint is Any:
        return "any value"
    return getattr(hint, "__name__", str(hint))


class _Loader:
    def __init__(
        self,
        source: str,
        passthrough: frozenset[str],
        unknown_key_hint: Callable[[str], str | None] | None,
    ) -> None:
        self.source = source
        self.passthrough = passthrough
        self.unknown_key_hint = unknown_key_hint

    def error(self, where: str, message: str) -> ValueError:
        text = f"{where}: {message}" if where else message
        return ValueError(f"{self.source}: {text}" if self.source else text)

    def load(self, schema: type[_T], data: object, key: str) -> _T:
        hints = _field_types(schema)
        if not isinstance(data, Mapping):
            raise self.error(
                key or schema.__name__,
                f"expected a mapping of {schema.__name__} keys ({', '.join(hints)}), got "
                f"{_show(data)}",
            )
        self._check_keys(schema, hints, data, key)
        config = OmegaConf.structured(_omegaconf_schema(schema, self.passthrough))
        later: dict[str, Any] = {}  # text, nested schemas and passthrough: set after omegaconf
        for name, value in data.items():
            hint = hints[name]
            problem = _kind_problem(hint, value, _join(key, name), name not in self.passthrough)
            if problem is not None:
                raise self.error(*problem)
            if value is not None and _set_later(name, hint, self.passthrough):
                later[name] = value
                value = "" if isinstance(value, str) else {} if isinstance(value, Mapping) else []
            try:
                OmegaConf.update(config, name, value, merge=False)
            except OmegaConfBaseException as err:
                raise self._translate(err, hints, data, key) from None
        try:
            checked = OmegaConf.to_container(config, resolve=False, throw_on_missing=True)
        except MissingMandatoryValue as err:
            name = str(err.full_key)
            raise self.error(
                _join(key, name),
                f"missing required key of {schema.__name__}; add it "
                f"({name}: <{describe_type(hints.get(name, Any))}>)",
            ) from None
        assert isinstance(checked, dict)
        # Only the keys the document gave: the dataclass supplies its own defaults.
        fields = {name: checked[name] for name in data}
        for name, value in later.items():
            fields[name] = self._nested(hints[name], value, _join(key, name))
        try:
            return schema(**fields)
        except ValueError as err:
            # The dataclass's own checks name the field relative to it ("fixed_s[1]: ...").
            raise self.error("", _join(key, str(err))) from None

    def _check_keys(
        self, schema: type, hints: Mapping[str, Any], data: Mapping[Any, Any], key: str
    ) -> None:
        for name in data:
            if name in hints:
                continue
            hint = self.unknown_key_hint(str(name)) if self.unknown_key_hint else None
            raise self.error(
                _join(key, str(name)),
                hint
                or f"unknown key of {schema.__name__}; remove it or fix its spelling (allowed: "
                f"{', '.join(hints)})",
            )

    def _nested(self, hint: Any, value: Any, where: str) -> Any:
        item = _nested_schema(hint)
        if item is None:
            return value
        if isinstance(value, Mapping):
            for name in value:
                if not isinstance(name, str):
                    raise self.error(f"{where}.{name}", f"expected a text key, got {_show(name)}")
            return {
                name: self.load(item, entry, f"{where}.{name}") for name, entry in value.items()
            }
        return [self.load(item, entry, f"{where}[{i}]") for i, entry in enumerate(value)]

    def _translate(
        self,
        err: OmegaConfBaseException,
        hints: Mapping[str, Any],
        data: Mapping[str, Any],
        key: str,
    ) -> ValueError:
        relative = str(err.full_key)
        where = _join(key, relative)
        match = _KEY.match(relative)
        if match is None or match["name"] not in hints:
            return self.error(where, str(err.msg))
        hint = hints[match["name"]]
        value: Any = data[match["name"]]
        for index in re.findall(r"\d+", match["indices"]):
            hint = _item_type(_strip_none(hint)) or Any
            value = value[int(index)]
        return self.error(where, _wrong_kind(hint, value))


def _set_later(name: str, hint: Any, passthrough: frozenset[str]) -> bool:
    """Whether the loader, not omegaconf, sets this field (omegaconf sees a placeholder).

    Text: omegaconf would read ``${...}`` and ``???`` in it as interpolation and MISSING.
    Nested schemas: loaded item by item so errors carry the whole key. Passthrough: checked by
    the dataclass itself.
    """
    return name in passthrough or _is_text(hint) or _nested_schema(hint) is not None


_OMEGACONF_SCHEMAS: dict[tuple[type, frozenset[str]], type] = {}


def _omegaconf_schema(schema: type, passthrough: frozenset[str]) -> type:
    """A plain dataclass omegaconf 2.3+ can hold, for the fields omegaconf checks.

    Same field names; numbers, booleans and lists of them keep their types (tuples become
    lists: omegaconf 2.3 cannot hold ``tuple[tuple[float, ...], ...]``); fields the loader sets
    itself are ``Any``. Required fields are ``MISSING``, optional ones default to ``None`` (the
    loader passes only the keys a document gives, so the real defaults apply). Not frozen:
    omegaconf makes a frozen dataclass's config read-only.
    """
    cache_key = (schema, passthrough)
    if cache_key not in _OMEGACONF_SCHEMAS:
        hints = _field_types(schema)
        fields: list[tuple[str, Any, Any]] = []
        for field in dataclasses.fields(schema):
            hint = hints[field.name]
            typed = Any if _set_later(field.name, hint, passthrough) else _plain(hint)
            required = (
                field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING
            )
            if required:
                fields.append((field.name, typed, dataclasses.field(default=MISSING)))
            else:
                optional = typed if typed is Any else typing.Optional[typed]  # noqa: UP045
                fields.append((field.name, optional, dataclasses.field(default=None)))
        _OMEGACONF_SCHEMAS[cache_key] = dataclasses.make_dataclass(schema.__name__, fields)
    return _OMEGACONF_SCHEMAS[cache_key]


def _plain(hint: Any) -> Any:
    """``hint`` as omegaconf 2.3 types it: scalars, optional scalars and lists; else ``Any``."""
    if hint in (int, float, bool, str):
        return hint
    if _is_union(hint):
        args = typing.get_args(hint)
        inner = [arg for arg in args if arg is not type(None)]
        if len(inner) == 1 and len(args) == 2:
            plain = _plain(inner[0])
            return Any if plain is Any else typing.Optional[plain]  # noqa: UP045
        return Any
    item = _item_type(hint)
    if item is not None:
        return list[_plain(item)]  # type: ignore[misc]
    return Any


def _join(path: str, name: str) -> str:
    if not path:
        return name
    return f"{path}{name}" if name.startswith("[") else f"{path}.{name}"


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def _field_types(schema: type) -> dict[str, Any]:
    """Each dataclass field's resolved annotation, in field order (cached per class)."""
    if schema not in _FIELD_TYPES:
        hints = typing.get_type_hints(schema)
        _FIELD_TYPES[schema] = {f.name: hints[f.name] for f in dataclasses.fields(schema)}
    return _FIELD_TYPES[schema]


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _strip_none(hint: Any) -> Any:
    if _is_union(hint):
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def _item_type(hint: Any) -> Any | None:
    """``X`` for ``list[X]``, ``tuple[X, ...]`` or ``Sequence[X]``; else ``None``."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (list, Sequence) and args:
        return args[0]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


def _nested_schema(hint: Any) -> type | None:
    """The dataclass of ``list[S]``, ``tuple[S, ...]`` or ``dict[str, S]``; else ``None``."""
    hint = _strip_none(hint)
    item = _item_type(hint)
    if item is None and typing.get_origin(hint) in (dict, Mapping):
        item = typing.get_args(hint)[1]
    return item if isinstance(item, type) and dataclasses.is_dataclass(item) else None


def _is_text(hint: Any) -> bool:
    """``str`` or ``list[str]`` (optional or not): nothing for omegaconf to convert."""
    hint = _strip_none(hint)
    return hint is str or _item_type(hint) is str


def _kind_problem(hint: Any, value: Any, where: str, deep: bool) -> tuple[str, str] | None:
    """``(key, message)`` if ``value`` (and, when ``deep``, each list entry) has the wrong kind."""
    if not _accepts(hint, value):
        return where, _wrong_kind(hint, value)
    item = _item_type(_strip_none(hint))
    listed = isinstance(value, list | tuple)
    if deep and listed and item is not None and not dataclasses.is_dataclass(item):
        for index, entry in enumerate(value):
            problem = _kind_problem(item, entry, f"{where}[{index}]", deep)
            if problem is not None:
                return problem
    return None


def _accepts(hint: Any, value: Any) -> bool:
    """Whether ``value`` is the right *kind* (text, number, bool, list, mapping) for ``hint``."""
    if _is_union(hint):
        return any(_accepts(arg, value) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    origin = typing.get_origin(hint) or hint
    if origin in (list, tuple, Sequence):
        return isinstance(value, list | tuple)
    if origin in (dict, Mapping) or dataclasses.is_dataclass(hint):
        return isinstance(value, Mapping)
    return True  # Any, enums, paths: omegaconf decides


def _wrong_kind(hint: Any, value: Any) -> str:
    expected = describe_type(hint)
    message = f"expected {expected}, got {_show(value)}"
    plain = _strip_none(hint)
    if plain in (int, float) and isinstance(value, str) and _is_number(value):
        return f"{message}; write the number without quotes"
    if plain is str and isinstance(value, int | float):
        return (
            f"{message}; quote it if it is text (YAML reads 1e5 as a number and on, off, "
            "yes, no as booleans)"
        )
    return f"{message}; write {_WRITE.get(plain, expected)}"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


_WRITE = {int: "an integer", float: "a number", str: "text", bool: "true or false"}


def _show(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"

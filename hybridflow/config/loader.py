"""Typed YAML config loading onto any dataclass schema.

Read YAML files (each may name base files under ``defaults:``), deep-merge
them in order (mappings key by key; lists and scalars replaced), apply
``key.sub=value`` overrides, build the dataclass tree with strict type checks
and call each ``validate()`` bottom-up. User errors are one-line ``ConfigError``s
naming the dotted key and, when known, the file or override that set it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import os
import types
from collections.abc import Iterable
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from hybridflow.util import write_atomically

__all__ = ["ConfigError", "Override", "load_config", "config_to_dict", "dump_yaml", "flat_items"]

Key = tuple[str, ...]


class ConfigError(ValueError):
    """A user-facing config mistake; the message is a single line."""


class Override(str):
    """A ``key.sub=value`` override that names its own origin in errors (e.g. the verl key it was
    translated from) instead of ``override 'key.sub=value'``."""

    source: str

    def __new__(cls, arg: str, source: str):
        override = super().__new__(cls, arg)
        override.source = source
        return override


# ------------------------------------------------------------------ reading
class _StrictLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys silently; a config typo hides that way."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    own = [k for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]  # `<<` may override
    keys = [loader.construct_object(k) for k in own]
    for i, key in enumerate(keys):
        if key in keys[:i]:  # list scan: keys may be unhashable; configs are small
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", own[i].start_mark)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if v is None and isinstance(dst.get(k), dict):
            continue  # an empty section (`trainer:` with nothing under it) overrides nothing
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            # deepcopy: YAML anchors alias objects, and later merges mutate dst.
            dst[k] = copy.deepcopy(v)


def _record(origin: dict[Key, str], data: dict, prefix: Key, source: str, merged: dict | None = None) -> None:
    """Mark every key of ``data`` as set by ``source``; an empty section over a section of ``merged`` sets
    nothing (``_merge`` kept the base's), so its keys keep their sources."""
    for k, v in data.items():
        if v is None and merged is not None and isinstance(merged.get(k), dict):
            continue
        origin[prefix + (str(k),)] = source
        if isinstance(v, dict):
            below = merged.get(k) if merged is not None else None
            _record(origin, v, prefix + (str(k),), source, below if isinstance(below, dict) else None)


def _read_file(path: str, chain: list[str], origin: dict[Key, str]) -> dict:
    """Load ``path`` merged over its ``defaults`` bases; fill ``origin``."""
    if os.path.abspath(path) in map(os.path.abspath, chain):
        raise ConfigError(f"defaults cycle: {' -> '.join([*chain, path])}")
    if not os.path.isfile(path):
        via = f" (listed in defaults of {chain[-1]})" if chain else ""
        raise ConfigError(f"config file not found: {path}{via}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    try:  # UTF-8 whatever the locale says (YAML's own encoding)
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path} is not UTF-8 text: byte {e.start} (line {line}) is 0x{raw[e.start]:02x}; "
                          "save the file as UTF-8") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).replace("\n", " ")
        raise ConfigError(f"invalid YAML in {path}{line}: {problem}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    bases = data.pop("defaults", [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: 'defaults' must be a list of file paths, got {bases!r}")
    merged: dict = {}
    for base in bases:  # base paths are relative to the file naming them
        base_path = os.path.normpath(os.path.join(os.path.dirname(path), base))
        _merge(merged, _read_file(base_path, [*chain, path], origin))
    _record(origin, data, (), path, merged)  # before the merge: what the bases set decides what `data` sets
    _merge(merged, data)
    return merged


def _apply_override(data: dict, origin: dict[Key, str], arg: Any) -> None:
    if not isinstance(arg, str) or "=" not in arg:
        raise ConfigError(f"bad override {arg!r}: expected key.sub=value")
    key, raw = arg.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"bad override {arg!r}: empty key segment in {key!r}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        raise ConfigError(f"bad override {arg!r}: value {raw!r} is not valid YAML") from None
    source = getattr(arg, "source", None) or f"override '{arg}'"
    node = data
    for i, part in enumerate(parts[:-1]):
        if node.get(part) is None:  # absent or `section: null`: create it
            node[part] = {}
            origin[tuple(parts[:i + 1])] = source
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"bad override {arg!r}: '{'.'.join(parts[:i + 1])}' "
                              f"is not a section (it is {_show(node)})")
    last = parts[-1]
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        _merge(node[last], value)
    else:
        node[last] = value
    origin[tuple(parts)] = source
    if isinstance(value, dict):
        _record(origin, value, tuple(parts), source)


# ----------------------------------------------------------------- building
def _dotted(path: Key) -> str:
    return "".join(p if p.startswith("[") or i == 0 else "." + p for i, p in enumerate(path))


def _show(v: Any) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 60 else r[:57] + '...'}"


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return f"one of {list(args)!r}"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', origin)}[{inner}]" if args else origin.__name__
    return getattr(tp, "__name__", repr(tp))


class _Builder:
    def __init__(self, origin: dict[Key, str]):
        self.origin = origin

    def where(self, path: Key) -> str | None:
        for n in range(len(path), 0, -1):  # nearest recorded ancestor wins
            if path[:n] in self.origin:
                return self.origin[path[:n]]
        return None

    def type_error(self, path: Key, expected: str, value: Any) -> ConfigError:
        at = f" (in {src})" if (src := self.where(path)) else ""
        return ConfigError(f"key '{_dotted(path)}' expects {expected}, got {_show(value)}{at}")

    def build(self, cls: type, value: Any, path: Key) -> Any:
        if not isinstance(value, dict):
            if not path:
                raise ConfigError(f"config root must be a mapping, got {_show(value)}")
            raise self.type_error(path, f"a mapping (section {cls.__name__})", value)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        for key in value:
            if key not in fields:
                full = _dotted(path + (str(key),))
                src = self.where(path + (str(key),))
                msg = f"unknown key '{full}'" + (f" in {src}" if src else "")
                close = difflib.get_close_matches(str(key), list(fields), n=1)
                if close:
                    msg += f"; did you mean '{_dotted(path + (close[0],))}'?"
                raise ConfigError(msg)
        hints, kwargs = get_type_hints(cls), {}  # resolves `from __future__` string annotations
        for name, f in fields.items():
            if name in value:
                kwargs[name] = self.convert(hints[name], value[name], path + (name,))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required key '{_dotted(path + (name,))}'")
        try:  # __post_init__ checks get the same treatment as validate()
            obj = cls(**kwargs)
            if callable(getattr(obj, "resolve_defaults", None)):  # keys defaulting to other keys' values
                obj.resolve_defaults()
            if callable(getattr(obj, "validate", None)):  # checks only: a validate never changes a value
                obj.validate()  # children were built, hence validated, first
        except ConfigError:
            raise
        except (ValueError, AssertionError) as e:
            msg = " ".join(str(e).split()) or f"{cls.__name__} validation failed"
            raise ConfigError(f"{_dotted(path)}: {msg}" if path else msg) from e
        return obj

    def _convert_union(self, tp: Any, v: Any, path: Key) -> Any:
        args = get_args(tp)
        if v is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:  # Optional[X]: X's own, more precise errors
            return self.convert(members[0], v, path)
        for member in members:
            try:
                return self.convert(member, v, path)
            except ConfigError:
                continue
        raise self.type_error(path, _type_name(tp), v)

    def _convert_items(self, item_types, v, path: Key) -> list:
        return [self.convert(t, x, path + (f"[{i}]",)) for i, (t, x) in enumerate(zip(item_types, v))]

    def convert(self, tp: Any, v: Any, path: Key) -> Any:
        origin, args = get_origin(tp), get_args(tp)
        if tp is Any or tp is object:
            return v
        if origin in (Union, types.UnionType):
            return self._convert_union(tp, v, path)
        if origin is Literal:
            if any(type(v) is type(a) and v == a for a in args):
                return v
            raise self.type_error(path, _type_name(tp), v)  # lists the allowed values
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            return self.build(tp, {} if v is None else v, path)  # `section:` with nothing under it: its defaults
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            for member in tp:
                if v == member.value or v == member.name or v is member:
                    return member
            raise self.type_error(path, f"one of {[m.value for m in tp]!r}", v)
        if tp in (bool, int, str, type(None)):
            if type(v) is tp:  # exact: YAML `1` is no bool, `true` no int, `1` no str
                return v
        elif tp is float:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
            if isinstance(v, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
                try:
                    return float(v)
                except ValueError:
                    pass
        elif tp in (list, tuple) or origin in (list, tuple):
            kind = origin or tp
            fixed = kind is tuple and args and args[-1] is not Ellipsis  # tuple[int, str]
            if isinstance(v, (list, tuple)) and (not fixed or len(v) == len(args)):
                items = self._convert_items(args if fixed else [args[0] if args else Any] * len(v), v, path)
                return tuple(items) if kind is tuple else items
        elif tp is dict or origin is dict:
            if isinstance(v, dict):
                kt, vt = args or (Any, Any)
                return {self.convert(kt, k, path + (str(k),)): self.convert(vt, x, path + (str(k),))
                        for k, x in v.items()}
        elif isinstance(tp, type):
            if isinstance(v, tp):
                return v
        else:
            raise TypeError(f"schema key '{_dotted(path)}' has unsupported annotation {tp!r}")
        raise self.type_error(path, _type_name(tp), v)


# ---------------------------------------------------------------- public API
def load_config(schema_cls: type, paths: str | os.PathLike | Iterable[str | os.PathLike],
                overrides: Iterable[str] = (), sources: dict[str, str] | None = None) -> Any:
    """Build ``schema_cls`` from YAML ``paths`` (or dicts of the same shape; later wins) plus CLI ``overrides``.

    ``sources``, when given, is filled with where each dotted key was set (a file, or ``override '...'``);
    keys not in it keep the schema's default."""
    if not (dataclasses.is_dataclass(schema_cls) and isinstance(schema_cls, type)):
        raise TypeError(f"schema_cls must be a dataclass type, got {schema_cls!r}")
    paths = [paths] if isinstance(paths, (str, os.PathLike, dict)) else paths
    data, origin = {}, {}  # merged config; key path -> file/override that set it
    for path in paths:
        if isinstance(path, dict):  # a mapping given in Python (same shape as a YAML file)
            _record(origin, path, (), "a Python dict", data)
            _merge(data, copy.deepcopy(path))
        else:
            _merge(data, _read_file(os.fspath(path), [], origin))
    # A lone string would otherwise iterate by character.
    overrides = [overrides] if isinstance(overrides, str) else overrides
    for arg in overrides:
        _apply_override(data, origin, arg)
    cfg = _Builder(origin).build(schema_cls, data, ())
    if sources is not None:
        sources.update({_dotted(k): v for k, v in origin.items()})
    return cfg


def flat_items(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of nested dicts (e.g. ``config_to_dict(cfg)``), in order."""
    out = []
    for k, v in data.items():
        out.extend(flat_items(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)])
    return out


def config_to_dict(cfg: Any) -> Any:
    """Plain YAML-safe data; only init fields, so the result loads back."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: config_to_dict(getattr(cfg, f.name))
                for f in dataclasses.fields(cfg) if f.init}
    if isinstance(cfg, enum.Enum):
        return cfg.value
    if isinstance(cfg, (list, tuple)):
        return [config_to_dict(x) for x in cfg]
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_yaml(cfg: Any, path: str | os.PathLike) -> None:
    """Write the config as YAML atomically (a temp file renamed over ``path``)."""
    write_atomically(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False))

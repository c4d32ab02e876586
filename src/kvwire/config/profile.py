"""Profiles: an `EngineConfig` written as YAML or as a plain mapping.

A profile mirrors `kvwire.EngineConfig`: its top-level keys are
the engine config's sections (`model_config`, `cache_config`,
`parallel_config`, `scheduler_config`, `kv_transfer_config`), each a
mapping of that record's fields; everything is optional.

Values are structured with cattrs under strict rules (`"false"` is not a
boolean, `3.5` is not an integer), then checked by the records' own
validators. Nothing stops at the first problem: `kvwire.exceptions.ProfileError`
lists every one, each with its dotted path and what would be accepted. Unknown keys are problems
too, so a typo is never silently ignored. YAML is read with PyYAML's safe loader only, bounded
against alias bombs (`kvwire.config.profile_yaml`). Values are shown in errors through
`kvwire.common.redaction.shown`: bounded, secrets blanked.

A profile is given by path or, for the profiles kvwire ships (package data in
`kvwire/profiles/`), by name: a string with no `/` that does not end in
`.yaml` or `.yml` is a name (`"cpu-offload"`); anything else, and any
`os.PathLike`, is a path (`"./cpu-offload"` reads a file of that name).
`shipped_profile_names()` lists the names (`kvwire profiles` prints them).
"""

from __future__ import annotations

import difflib
import os
import pathlib
import types
import typing
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any, Literal

import attrs
import cattrs

from kvwire.common.redaction import SHOWN_LENGTH, kind_of, scrub, secrets_in_text, shown, shown_key
from kvwire.config.bounded_file import FileRefused, read_regular_file, shown_path
from kvwire.config.engine_config import EngineConfig
from kvwire.config.profile_yaml import ProfileYAMLError, parse_profile_text
from kvwire.exceptions import KVWireError, ProfileError

MAPPING_ORIGIN = "<mapping>"
# A profile is a few hundred bytes; a megabyte is already absurd.
MAX_PROFILE_BYTES = 1024 * 1024

ProfileSource = str | os.PathLike[str] | Mapping[str, Any]

# Where the shipped profiles live, inside the installed package.
SHIPPED_PROFILES_FOLDER = "profiles"
PROFILE_SUFFIXES = (".yaml", ".yml")
# The profile `kvwire run` runs when given none.
DEFAULT_PROFILE_NAME = "cpu-offload"


def load_profile(source: ProfileSource) -> EngineConfig:
    """Build the `kvwire.EngineConfig` a profile describes.

    `source` is a shipped profile's name (`"cpu-offload"`), a path to a YAML
    file (`str` or path-like) or an already parsed mapping. Raises
    `kvwire.exceptions.ProfileError` listing every problem.
    """
    if not isinstance(source, str | os.PathLike):
        # A mapping, or something that is neither: the structuring says which.
        return structure_engine_config(source, origin=MAPPING_ORIGIN)
    path = profile_path(source)
    return structure_engine_config(read_profile_file(path), origin=profile_origin(source))


def is_profile_name(source: str | os.PathLike[str]) -> bool:
    """Whether `source` names a shipped profile rather than a file.

    A `str` with no `/` (nor the platform's separator) that does not end in
    `.yaml` or `.yml` is a name; a path-like object never is.
    """
    if not isinstance(source, str):
        return False
    separators = [separator for separator in ("/", os.sep, os.altsep) if separator]
    return not any(separator in source for separator in separators) and not source.endswith(
        PROFILE_SUFFIXES
    )


def shipped_profile_names() -> list[str]:
    """The names of the profiles kvwire ships, sorted (`kvwire profiles` lists them)."""
    folder = resources.files("kvwire").joinpath(SHIPPED_PROFILES_FOLDER)
    if not folder.is_dir():
        return []  # an installation without its package data: names are then unknown
    return sorted(
        entry.name.removesuffix(".yaml")
        for entry in folder.iterdir()
        if entry.name.endswith(".yaml") and entry.is_file()
    )


def shipped_profile_path(name: str) -> pathlib.Path:
    """The file of the shipped profile `name`; an unknown name is a `ProfileError`.

    The error lists the shipped names (with the closest one first, when one
    is close) and says that a path works too.
    """
    names = shipped_profile_names()
    if name not in names:
        raise ProfileError(profile_origin(name), [_unknown_name(name, names)])
    folder = resources.files("kvwire").joinpath(SHIPPED_PROFILES_FOLDER)
    # Installed, the package is a plain folder (a wheel's files, an editable install).
    return pathlib.Path(str(folder.joinpath(f"{name}.yaml")))


def profile_path(source: str | os.PathLike[str]) -> pathlib.Path:
    """The file `source` designates: a shipped profile's when it is a name, else `source`."""
    if is_profile_name(source):
        return shipped_profile_path(os.fspath(source))
    return pathlib.Path(source)


def profile_origin(path: str | os.PathLike[str]) -> str:
    """How errors name the profile at `path` (or of that name): as given, or escaped and cut
    when unprintable."""
    return shown_path(path)


def _unknown_name(name: str, names: list[str]) -> str:
    message = f"no shipped profile is named {shown(name)}"
    close = difflib.get_close_matches(name, names, n=1) if len(name) <= SHOWN_LENGTH else []
    if close:
        message += f" (did you mean {close[0]!r}?)"
    if names:
        message += f"; the shipped profiles are {', '.join(names)} (kvwire profiles lists them)"
    else:
        message += (
            f"; this installation of kvwire has no shipped profiles (kvwire/"
            f"{SHIPPED_PROFILES_FOLDER}/ is missing: reinstall kvwire)"
        )
    message += "; a path to a YAML file works too: one with a / or ending in .yaml or .yml"
    if os.path.exists(name) and len(name) <= SHOWN_LENGTH and name.isprintable():
        message += f", so ./{name} reads the file of that name here"
    return message


def read_profile_file(path: pathlib.Path) -> Any:
    """The parsed YAML document at `path` (an empty file is an empty mapping)."""
    origin = profile_origin(path)
    if "\x00" in os.fspath(path):
        # open() would only say "embedded null byte", naming nothing.
        raise ProfileError(
            origin, ["the profile path contains a NUL byte (\\x00), which no file name can hold"]
        )
    try:
        # A regular file, read no further than a profile can be: a FIFO must
        # not block, /dev/zero must not fill memory.
        text = read_regular_file(path, MAX_PROFILE_BYTES).decode("utf-8")
    except FileRefused as error:
        raise ProfileError(
            origin, [f"cannot read the profile: {error}; a profile is a regular YAML file"]
        ) from None
    except OSError as error:
        raise ProfileError(origin, [f"cannot read the profile: {error.strerror}"]) from None
    except UnicodeDecodeError as error:
        raise ProfileError(origin, [f"the profile is not UTF-8 text: {error.reason}"]) from None
    try:
        document = parse_profile_text(text)
    except ProfileYAMLError as error:
        # The message quotes no source line, but a token (an alias name)
        # could still be a secret typed in the wrong place.
        problem = scrub(str(error), secrets_in_text(text))
        raise ProfileError(origin, [f"not valid YAML: {problem}"]) from None
    return {} if document is None else document


def structure_engine_config(data: Any, *, origin: str = MAPPING_ORIGIN) -> EngineConfig:
    """Structure a parsed profile; `origin` names it in the error."""
    problems: list[str] = []
    sections = _section_types()
    if not isinstance(data, Mapping):
        raise ProfileError(
            origin,
            [
                f"the profile must be a mapping whose keys are {_join(sections)}, "
                f"got {kind_of(data)}"
            ],
        )
    records: dict[str, Any] = {}
    for key, value in data.items():
        if key not in sections:
            problems.append(_unknown_key(shown_key(key), key, sections))
            continue
        record_type = sections[key]
        if value is None and _is_optional(attrs.fields_dict(EngineConfig)[key].type):
            records[key] = None
            continue
        record = _structure_record(record_type, value, key, problems)
        if record is not None:
            records[key] = record
    if problems:
        raise ProfileError(origin, problems)
    try:
        return EngineConfig(**records)
    except ValueError as error:
        # Checks across sections: what the KV cache and weights need in memory.
        raise ProfileError(origin, [str(error)]) from None


def unstructure_engine_config(engine_config: EngineConfig) -> dict[str, Any]:
    """The profile mapping of `engine_config`: what `kvwire.load_profile` turns back
    into it.

    Useful to hand an engine's exact configuration (`engine_id` included)
    to another process.
    """
    unstructured: dict[str, Any] = _converter.unstructure(engine_config)
    return unstructured


# ----------------------------------------------------------------- internals


class _Rejected(KVWireError):
    """A value of the wrong kind; the message is built from the field's type."""


def _strict(kind: type, accepts: Callable[[Any], bool]) -> Callable[[Any, type], Any]:
    def structure(value: Any, _: type) -> Any:
        if not accepts(value):
            raise _Rejected
        return kind(value)

    return structure


def _structure_str_mapping(value: Any, _: type) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise _Rejected
    return dict(value)


def _structure_literal(value: Any, literal: Any) -> Any:
    if value not in typing.get_args(literal):
        raise _Rejected
    return value


def _is_dict_type(kind: Any) -> bool:
    return typing.get_origin(kind) is dict


def _is_literal_type(kind: Any) -> bool:
    return typing.get_origin(kind) is Literal


def _make_converter() -> cattrs.Converter:
    # cattrs calls the target type on the value by default, so "false" would
    # become True and 3.9 would become 3. A profile is user input: demand the
    # kind the field declares.
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(bool, _strict(bool, lambda value: isinstance(value, bool)))
    converter.register_structure_hook(
        int, _strict(int, lambda value: isinstance(value, int) and not isinstance(value, bool))
    )
    converter.register_structure_hook(
        float,
        _strict(
            float, lambda value: isinstance(value, int | float) and not isinstance(value, bool)
        ),
    )
    converter.register_structure_hook(str, _strict(str, lambda value: isinstance(value, str)))
    converter.register_structure_hook_func(_is_dict_type, _structure_str_mapping)
    converter.register_structure_hook_func(_is_literal_type, _structure_literal)
    return converter


_converter = _make_converter()


def _section_types() -> dict[str, type]:
    attrs.resolve_types(EngineConfig)
    sections: dict[str, type] = {}
    for field in attrs.fields(EngineConfig):
        record_type = next(
            arg for arg in (*typing.get_args(field.type), field.type) if attrs.has(arg)
        )
        sections[field.name] = record_type
    return sections


def _structure_record(record_type: type, data: Any, path: str, problems: list[str]) -> Any:
    """One section's record, or None after appending its problems to `problems`."""
    if not isinstance(data, Mapping):
        problems.append(
            f"{path}: expected a mapping of {record_type.__name__} fields, got {kind_of(data)}"
        )
        return None
    attrs.resolve_types(record_type)
    fields = attrs.fields_dict(record_type)
    found_before = len(problems)
    values: dict[str, Any] = {}
    for key, value in data.items():
        field_path = f"{path}.{shown_key(key)}"
        if key not in fields:
            problems.append(_unknown_key(field_path, key, fields))
            continue
        if value is None and fields[key].default is None:
            # null where the default is None means "the default" (engine_id: null -> a uuid).
            values[key] = None
            continue
        try:
            values[key] = _converter.structure(value, fields[key].type)  # type: ignore[arg-type]
        except Exception:  # cattrs raises several kinds; each means "not this type"
            shown_value = shown(value, key=key)
            problems.append(f"{field_path}: {shown_value} is not {_describe(fields[key].type)}")
    rejected = {key for key in data if key in fields and key not in values}
    _validate_fields(record_type, values, rejected, path, problems)
    if len(problems) > found_before:
        return None
    try:
        return record_type(**values)
    except (ValueError, TypeError) as error:
        # Only checks across fields are left (e.g. rank < world_size).
        problems.append(f"{path}: {error}")
        return None


def _validate_fields(
    record_type: type,
    values: dict[str, Any],
    data_keys_rejected: set[str],
    path: str,
    problems: list[str],
) -> None:
    # attrs stops at the first failing validator; run each field's on its own
    # so that every bad value is reported. Fields left out are checked with
    # their defaults (a connector without a kv_role is a kv_role problem);
    # fields of the wrong type were reported already and are skipped.
    # Validators that look at other fields see them through a stand-in.
    fields = attrs.fields(record_type)
    converted: dict[str, Any] = {}
    for field in fields:
        # In field order: a default computed from earlier fields sees them.
        converted[field.name] = _converted(field, values, converted)
    stand_in = types.SimpleNamespace(**converted)
    for field in fields:
        if field.validator is None or field.name in data_keys_rejected:
            continue
        try:
            field.validator(stand_in, field, converted[field.name])
        except (ValueError, TypeError) as error:
            message = str(error)
            # Some validators start with the field's name; the path already says it.
            message = message.removeprefix(f"{field.name}: ")
            problems.append(f"{path}.{field.name}: {message}")


def _converted(field: attrs.Attribute[Any], values: dict[str, Any], earlier: dict[str, Any]) -> Any:
    # attrs runs converters on defaults too (engine_id: None -> a fresh uuid).
    value = values[field.name] if field.name in values else _default(field, earlier)
    return value if field.converter is None else field.converter(value)  # type: ignore[operator]


def _default(field: attrs.Attribute[Any], earlier: dict[str, Any]) -> Any:
    default: Any = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        if default.takes_self:
            return default.factory(types.SimpleNamespace(**earlier))
        return default.factory()
    return default


def _is_optional(kind: Any) -> bool:
    return type(None) in typing.get_args(kind)


def _describe(kind: Any) -> str:
    """What a value of type `kind` looks like, in a user's words."""
    if kind is bool:
        return "true or false"
    if kind is int:
        return "an integer"
    if kind is float:
        return "a number"
    if kind is str:
        return "a string"
    origin = typing.get_origin(kind)
    if origin is dict:
        return "a mapping with string keys"
    if origin is Literal:
        return "one of " + ", ".join(str(choice) for choice in typing.get_args(kind))
    if origin in (typing.Union, types.UnionType):
        choices = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        return " or ".join(_describe(choice) for choice in choices)
    return getattr(kind, "__name__", str(kind))


def _unknown_key(path: str, key: object, accepted: Mapping[str, Any]) -> str:
    message = f"{path}: unknown key; accepted keys are {_join(accepted)}"
    if not isinstance(key, str) or len(key) > SHOWN_LENGTH:
        return message
    close = difflib.get_close_matches(key, list(accepted), n=1)
    return f"{message} (did you mean {close[0]!r}?)" if close else message


def _join(names: Mapping[str, Any]) -> str:
    return ", ".join(names)

"""Validation of a connector's `kv_connector_extra_config`.

Each connector declares the keys it understands as `kvwire.media.ExtraConfigKey`
records; `read_extra_config` checks a user's mapping against them and
returns the values with defaults filled in. Every error names
`kv_connector_extra_config.<key>` and says what would be accepted, and an
unknown key is an error (a typo must not silently fall back to a default).
Values are shown bounded and with secrets blanked (`kvwire.common.redaction`);
a size that is allocated in memory (`kvwire.media.memory_size_key`) is checked
against what this machine holds.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import attrs

from kvwire.common.redaction import SHOWN_LENGTH, shown, shown_key
from kvwire.config.memory_limits import describe_bytes, memory_shortfall
from kvwire.exceptions import ExtraConfigError as ExtraConfigError
from kvwire.exceptions import ValueRefused as ValueRefused

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
# Digits are bounded: no byte count needs more, and converting thousands of
# digits is slow (and refused past 4300 on recent Pythons).
# ASCII only: \d alone would also read other scripts' digits (fullwidth, Arabic-Indic).
_SIZE_PATTERN = re.compile(r"^\s*(\d{1,30}(?:\.\d{1,30})?)\s*([a-zA-Z]{0,3})\s*$", re.ASCII)
# 8 EiB: the largest byte count an OS call or a C size_t-based library takes.
LARGEST_SIZE = 2**63 - 1


def parse_size(value: object) -> int | None:
    """Bytes from an int or a string such as `"512MiB"` or `"2GB"`; None if unreadable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None  # inf and nan are not integers
    if not isinstance(value, str):
        return None
    match = _SIZE_PATTERN.match(value)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        return None
    # Exact arithmetic: a float would turn a long count into inf, or round it.
    size = Fraction(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    # "1.3" bytes names no size; rounding it would silently take another.
    return int(size) if size.denominator == 1 else None


@attrs.frozen
class ExtraConfigKey:
    """One key a connector accepts: its default and how a value is checked.

    `convert` returns the accepted value, or None when the value is not
    acceptable; `accepted` describes acceptable values for the error text.
    `plugin` is set for a key whose value names a plug-in class: the
    registry's lookup of that kind (`"eviction_policies"`), through which
    `plugin_classes` resolves it.
    """

    name: str
    default: Any
    convert: Callable[[Any], Any]
    accepted: str
    plugin: str = ""


def size_key(name: str, default: int, minimum: int = 1) -> ExtraConfigKey:
    """A byte count: an int, or a string with a unit ("64MiB", "2GB"), up to 8 EiB."""

    def convert(value: Any) -> int | None:
        size = parse_size(value)
        return size if size is not None and minimum <= size <= LARGEST_SIZE else None

    return ExtraConfigKey(
        name,
        default,
        convert,
        f'a byte count >= {minimum}, as an int or a string such as "512MiB"',
    )


def memory_size_key(name: str, default: int, minimum: int = 1) -> ExtraConfigKey:
    """A byte count the connector allocates in memory: also no more than this machine holds.

    Checked when the extra config is read, so `kvwire check` and the
    connector's constructor both refuse it, by name, before anything is
    allocated.
    """
    size = size_key(name, default, minimum)

    def convert(value: Any) -> int | None:
        converted: int | None = size.convert(value)
        if converted is not None:
            shortfall = memory_shortfall(converted)
            if shortfall:
                raise ValueRefused(
                    f"{describe_bytes(converted)} would be allocated in memory, {shortfall}"
                )
        return converted

    return ExtraConfigKey(name, default, convert, size.accepted)


def int_key(
    name: str, default: int | None, minimum: int, maximum: int | None = None, counts: str = ""
) -> ExtraConfigKey:
    """An integer from `minimum` to `maximum`; `counts` (what it counts) ends its error text."""

    def convert(value: Any) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        if value < minimum or (maximum is not None and value > maximum):
            return None
        return value

    bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
    accepted = f"an integer {bound}" + (f" ({counts})" if counts else "")
    return ExtraConfigKey(name, default, convert, accepted)


def bool_key(name: str, default: bool) -> ExtraConfigKey:
    return ExtraConfigKey(
        name, default, lambda value: value if isinstance(value, bool) else None, "true or false"
    )


def finite_seconds(
    value: Any, maximum: float, *, zero: bool = False, whole: bool = False
) -> float | None:
    """`value` as a duration in seconds, or None when it is not one that is accepted.

    Accepted: a number > 0 (>= 0 with `zero`; an int with `whole`) and <=
    `maximum`. Every duration option is read through it: an infinite or
    huge one overflows the calls that wait on it (a socket timeout, a
    `time.monotonic()` deadline, Redis's expiry), so every duration has a
    finite bound, and NaN, which compares false with every bound, is refused.
    """
    if isinstance(value, bool) or not isinstance(value, int if whole else int | float):
        return None
    above_zero = value >= 0 if zero else value > 0
    # Written so that NaN fails both comparisons.
    return float(value) if above_zero and value <= maximum else None


def seconds_accepted(maximum: float, *, zero: bool = False, whole: bool = False) -> str:
    """What `finite_seconds` accepts, as an error says it (`"a finite number of seconds ..."`)."""
    kind = "a whole number of seconds" if whole else "a finite number of seconds"
    return f"{kind} {'>=' if zero else '>'} 0 and <= {_duration_text(maximum)}"


def _duration_text(seconds: float) -> str:
    """`3600` as `"3600 (1 hour)"`: the bound as it is typed, and in an operator's unit."""
    if not float(seconds).is_integer():
        return f"{seconds:g}"
    whole = int(seconds)
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if whole >= size and whole % size == 0:
            count = whole // size
            return f"{whole} ({count} {unit}{'s' if count > 1 else ''})"
    return str(whole)


def seconds_key(name: str, default: float, maximum: float) -> ExtraConfigKey:
    """A duration in seconds: a finite number > 0 and <= `maximum` (see `finite_seconds`)."""
    return ExtraConfigKey(
        name, default, lambda value: finite_seconds(value, maximum), seconds_accepted(maximum)
    )


def str_key(name: str, default: str | None, required: bool = False) -> ExtraConfigKey:
    def convert(value: Any) -> str | None:
        return value if isinstance(value, str) and value else None

    accepted = "a non-empty string" + (" (required)" if required else "")
    return ExtraConfigKey(name, _REQUIRED if required else default, convert, accepted)


class _Required:
    def __repr__(self) -> str:
        return "<required>"


_REQUIRED: Any = _Required()


def _did_you_mean(name: object, known: Mapping[str, object]) -> str:
    """The hint naming the accepted key closest to a misspelled `name`, or "" if none is."""
    if not isinstance(name, str) or len(name) > SHOWN_LENGTH:
        return ""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def read_extra_config(
    connector_name: str, extra_config: Mapping[str, Any], keys: Sequence[ExtraConfigKey]
) -> dict[str, Any]:
    """Every declared key's value (checked) or default; raise on any unknown or bad key.

    All problems are collected and reported together, one per line.
    """
    known = {key.name: key for key in keys}
    problems: list[str] = []
    # Sorted by their text: keys of mixed types (from a Python mapping) do not compare.
    unknown = sorted((key for key in extra_config if key not in known), key=shown_key)
    for name in unknown:
        problems.append(
            f"kv_connector_extra_config.{shown_key(name)} is not an option of {connector_name}"
            f"{_did_you_mean(name, known)}; "
            f"accepted keys are: {', '.join(sorted(known)) or '(none)'}"
        )
    values: dict[str, Any] = {}
    for key in keys:
        if key.name not in extra_config:
            if key.default is _REQUIRED:
                problems.append(
                    f"kv_connector_extra_config.{key.name} is required by {connector_name}: "
                    f"{key.accepted}"
                )
            values[key.name] = key.default
            continue
        raw = extra_config[key.name]
        try:
            converted = key.convert(raw)
        except ValueRefused as refused:
            problems.append(f"kv_connector_extra_config.{key.name}: {refused}")
            converted = None
        else:
            if converted is None:
                problems.append(
                    f"kv_connector_extra_config.{key.name}: {shown(raw, key=key.name)} is not "
                    f"accepted by {connector_name}; expected {key.accepted}"
                )
        values[key.name] = converted
    if problems:
        raise ExtraConfigError("\n".join(problems))
    return values


@attrs.frozen
class ResolvedMedium:
    """One medium of a list-of-media option (a tiered medium's `tiers`), resolved and read.

    `medium_class` is the class its `medium` names, `options` the rest of
    its mapping read over that class's keys and finished, `plugins` the
    classes its own plug-in options name.
    """

    name: str
    """The medium as the option named it, bounded for messages."""
    medium_class: type
    options: Mapping[str, Any] = attrs.field(repr=False)
    plugins: Mapping[str, Any] = attrs.field(factory=dict)


def plugin_classes(
    keys: Sequence[ExtraConfigKey], options: Mapping[str, Any], registry: object
) -> dict[str, Any]:
    """The class each plug-in key's value names (by key), resolved through `registry`.

    `options` are the values `read_extra_config` read over `keys`; each key
    with a `plugin` is looked up in that lookup of `registry` (a
    `ConnectorRegistry`: `registry.eviction_policies`), whose
    `get_class` raises a `ValueError` for a name it does not know. A key
    whose value is a tuple of mappings, each naming a medium under `medium`
    (`plugin="media"`), resolves to a tuple of `ResolvedMedium`, each read
    over its own medium's keys. Every error names its key, one per line
    (`ExtraConfigError`).
    """
    classes: dict[str, Any] = {}
    problems: list[str] = []
    for key in keys:
        if not key.plugin:
            continue
        lookup = getattr(registry, key.plugin, None)
        if lookup is None:
            problems.append(
                f"kv_connector_extra_config.{key.name}: the registry has no {key.plugin} to "
                "look its value up in"
            )
            continue
        value = options.get(key.name, key.default)
        if isinstance(value, tuple):
            resolved = []
            for i, item in enumerate(value):
                try:
                    resolved.append(_resolved_medium(f"{key.name}[{i}]", item, lookup, registry))
                except ExtraConfigError as error:
                    problems.append(str(error))
            classes[key.name] = tuple(resolved)
            continue
        try:
            classes[key.name] = lookup.get_class(value)
        except ValueError as error:
            problems.append(f"kv_connector_extra_config.{key.name}: {error}")
    if problems:
        raise ExtraConfigError("\n".join(problems))
    return classes


def _resolved_medium(
    field: str, item: Mapping[str, Any], lookup: Any, registry: object
) -> ResolvedMedium:
    """One item of a list of media: its class, its options read over its keys, its plug-ins."""
    prefix = f"kv_connector_extra_config.{field}"
    try:
        medium_class = lookup.get_class(item["medium"])
    except ValueError as error:
        raise ExtraConfigError(f"{prefix}.medium: {error}") from None
    # The medium's name as written, bounded: a class path may be any length.
    name = f"{field} ({shown_key(item['medium'])})"
    rest = {k: v for k, v in item.items() if k != "medium"}
    try:
        read = read_extra_config(name, rest, medium_class.extra_config_keys())
        read = medium_class.finish_options(name, read)
        plugins = plugin_classes(medium_class.extra_config_keys(), read, registry)
    except ExtraConfigError as error:
        # Each line named the option as if at the top level: name it in its item.
        lines = str(error).replace("kv_connector_extra_config.", f"{prefix}.")
        raise ExtraConfigError(lines) from None
    return ResolvedMedium(shown_key(item["medium"]), medium_class, read, plugins)

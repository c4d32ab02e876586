"""How kvwire shows a user's value: never a secret, never more than a line.

Everything an error, a log line or a repr says about a configuration value
goes through here. A value under a secret-like key (`password`,
`*_password`, `token`, `secret`...) is shown as `***`, and so is the
password of a URL (`redis://user:***@host`) wherever it appears. What is
left is cut to a bounded length, with the size of what was cut, so that a
huge value (an expanded YAML alias bomb, a megabyte string) costs no more to
show than a small one: `shown` walks only as much of a value as it
prints.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote

REDACTED = "***"
SHOWN_LENGTH = 80

# Key names whose values are secrets. "password_env" is not one of them: it
# names the environment variable, which is what a user needs to see.
_SECRET_NAMES = frozenset(
    {
        "password",
        "passwd",
        "token",
        "secret",
        "credentials",
        "api_key",
        "apikey",
        "private_key",
        "secret_key",
        "access_key",
        "auth_token",
        # Refused in a profile (the MAC key comes from mac_key_env), but never shown.
        "mac_key",
    }
)
_SECRET_SUFFIXES = (
    "_password",
    "_passwd",
    "_token",
    "_secret",
    "_api_key",
    "_private_key",
    "_mac_key",
)

# A secret shorter than this is not searched for in text: blanking every "ab"
# of a message would hide what it says. Key names and URLs still blank it.
SHORTEST_SCRUBBED_SECRET = 4

# Text is scanned in runs without spaces: a URL is one run (quotes included:
# a password may hold one), and scanning each run once keeps the cost linear
# in the text whatever it holds.
_RUN = re.compile(r"\S+")
# A secret-like name followed by '=' or ':' (a URL query, a log line, a YAML
# line); the value runs to the next separator. The look-behind starts a name
# only where a word starts, which keeps the scan linear.
_NAMED_SECRET = re.compile(
    r"(?<![a-zA-Z0-9_-])(?P<name>(?:[a-zA-Z0-9_-]*[_-])?"
    r"(?:password|passwd|token|secret|api_?key|credentials|private_key|secret_key|access_key))"
    r"(?P<separator>['\"]?[ \t]*[=:][ \t]*)(?P<value>['\"]?[^\s'\"&,;}\]]+)",
    re.IGNORECASE,
)


# "name: value" on one line of YAML-like text (perhaps a list item), for a
# secret-like name. A '-' marks an item only before a space: a line of dashes
# must not be split every way while looking for a name.
_SECRET_LINE = re.compile(
    r"^[ \t]*(?:-[ \t]+)*['\"]?(?P<name>(?:[a-zA-Z0-9_-]*[_-])?"
    r"(?:password|passwd|token|secret|api_?key|credentials|private_key|secret_key|access_key))"
    r"['\"]?[ \t]*:(?P<value>.*)$",
    re.IGNORECASE | re.MULTILINE,
)


def is_secret_key(name: object) -> bool:
    """Whether a mapping key names a secret: `password`, `redis_password`, `token`..."""
    if not isinstance(name, str):
        return False
    normalized = name.strip().lower().replace("-", "_")
    return normalized in _SECRET_NAMES or normalized.endswith(_SECRET_SUFFIXES)


def redact_text(text: str) -> str:
    """`text` with URL passwords and `name=value` or `name: value` secrets blanked."""
    text = _RUN.sub(_blank_url_credentials, text)
    return _NAMED_SECRET.sub(_blank_named, text)


def redact_value(value: str) -> str:
    """A whole string value (not free text) with its secrets blanked.

    A value is one URL at most, so its credentials run to its last '@',
    spaces included: a password may hold anything a user typed.
    """
    return redact_text(_blank_url_in(value))


def _blank_url_credentials(match: re.Match[str]) -> str:
    return _blank_url_in(match.group(0))


def _blank_url_in(run: str) -> str:
    scheme_end = run.find("://")
    # The last '@': a password a user forgot to percent-encode may hold '/' or '@'.
    at = run.rfind("@")
    if scheme_end < 0 or at < scheme_end:
        return run
    user, colon, _ = run[scheme_end + 3 : at].partition(":")
    # Without a ':' the user part may be the credential itself (scheme://token@host).
    credentials = f"{user}:{REDACTED}" if colon else REDACTED
    return f"{run[: scheme_end + 3]}{credentials}{run[at:]}"


def _blank_named(match: re.Match[str]) -> str:
    value = match.group("value")
    quote = value[0] if value[0] in "'\"" else ""
    return f"{match.group('name')}{match.group('separator')}{quote}{REDACTED}"


def shown(value: object, *, key: object = None, limit: int = SHOWN_LENGTH) -> str:
    """`repr(value)` for a message: secrets blanked, at most about `limit` characters.

    `key` is the name the value was given under: a secret-like one shows
    `***` whatever the value. A cut repr ends with `...` and says how big
    the value was (`'aaaa...' (a str of 1000000 characters)`).
    """
    if is_secret_key(key):
        return REDACTED
    pieces: list[str] = []
    complete = _write(value, pieces, budget=limit + 1)
    text = "".join(pieces)
    if complete and len(text) <= limit:
        return text
    return f"{text[:limit]}... ({_size_of(value)})"


def shown_key(key: object) -> str:
    """A mapping key as a dotted path shows it: as written when short and printable, or bounded."""
    if isinstance(key, str) and key.isprintable() and len(key) <= SHOWN_LENGTH:
        return key
    return shown(key)


def kind_of(value: object) -> str:
    """How an error names a value it must not echo, a possible secret: by its type alone.

    `"a str"`, `"an int"`, `"None"`.
    """
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _write(value: object, pieces: list[str], budget: int) -> bool:
    """Append `value`'s redacted repr to `pieces` until `budget` characters; True if whole.

    Walks containers lazily: a value with a billion elements costs `budget`
    characters of work, not a billion.
    """
    written = sum(len(piece) for piece in pieces)
    if written >= budget:
        return False
    if isinstance(value, Mapping):
        return _write_items(
            "{", "}", ((key, item) for key, item in value.items()), pieces, budget, mapping=True
        )
    if isinstance(value, list | tuple | set | frozenset):
        brackets = "[]" if isinstance(value, list) else "()" if isinstance(value, tuple) else "{}"
        return _write_items(
            brackets[0],
            brackets[1],
            ((None, item) for item in value),
            pieces,
            budget,
            mapping=False,
        )
    pieces.append(_scalar_repr(value, budget - written))
    return sum(len(piece) for piece in pieces) <= budget


def _write_items(
    opening: str,
    closing: str,
    items: Any,
    pieces: list[str],
    budget: int,
    *,
    mapping: bool,
) -> bool:
    pieces.append(opening)
    for index, (key, item) in enumerate(items):
        if index:
            pieces.append(", ")
        if mapping:
            if not _write(key, pieces, budget):
                return False
            pieces.append(": ")
            if is_secret_key(key):
                pieces.append(repr(REDACTED))
                continue
        if not _write(item, pieces, budget):
            return False
    pieces.append(closing)
    return sum(len(piece) for piece in pieces) <= budget


def _scalar_repr(value: object, room: int) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        # str() of a huge int is slow, and refused past 4300 digits.
        return f"<an integer of about {_digits(value)} digits>"
    if isinstance(value, str):
        # The whole string is redacted before it is cut: a cut URL would no
        # longer show where its password ends.
        return repr(redact_value(value)[: max(room, 0) + 1])
    if isinstance(value, bytes):
        return repr(value[: max(room, 0)])
    return redact_text(repr(value))


def _size_of(value: object) -> str:
    article = "an" if type(value).__name__[0] in "aeiou" else "a"
    kind = f"{article} {type(value).__name__}"
    if isinstance(value, str | bytes):
        return f"{kind} of {len(value)} characters"
    if isinstance(value, Mapping):
        return f"{kind} of {len(value)} keys"
    if isinstance(value, list | tuple | set | frozenset):
        return f"{kind} of {len(value)} items"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"an integer of about {_digits(value)} digits"
    return kind


def _digits(value: int) -> int:
    # log10(2) ~ 0.30103: exact enough to say how absurd a number is.
    return int((abs(value).bit_length() - 1) * 0.30103) + 1


def secret_values(value: Any) -> set[str]:
    """Every secret `value` holds: values under secret-like keys, URL passwords, and the
    values of environment variables named by `<secret>_env` keys (`password_env`).

    For scrubbing text that may quote them by value, whatever the key (see `scrub`).
    """
    found: set[str] = set()
    # Iterative, with a visited set: a structure may contain itself.
    pending: list[tuple[object, Any]] = [(None, value)]
    seen: set[int] = set()
    while pending:
        key, item = pending.pop()
        if isinstance(item, Mapping | list | tuple):
            if id(item) in seen:
                continue
            seen.add(id(item))
        if is_secret_key(key) and not isinstance(item, Mapping | list | tuple):
            if item is not None and not isinstance(item, bool):
                found.add(str(item))
        elif isinstance(key, str) and key.endswith("_env") and isinstance(item, str):
            named = key.removesuffix("_env")
            if (is_secret_key(named) or named.endswith("_key")) and os.environ.get(item):
                found.add(os.environ[item])
        if isinstance(item, Mapping):
            pending.extend(item.items())
        elif isinstance(item, list | tuple):
            # A list under a secret key is secret all through.
            pending.extend((key if is_secret_key(key) else None, child) for child in item)
        elif isinstance(item, str):
            found.update(_url_passwords(item, whole_value=True))
    return {secret for secret in found if len(secret) >= SHORTEST_SCRUBBED_SECRET}


def secrets_in_text(text: str) -> set[str]:
    """The values of secret-like keys on the lines of `text`, and its URL passwords.

    For text that could not be parsed (a YAML syntax error): what a message
    about it must not quote.
    """
    found = set(_url_passwords(text))
    # Block style ("password: a value" to the line's end) and flow style
    # ("{password: value, ...}").
    values = [match.group("value") for match in _SECRET_LINE.finditer(text)]
    values += [match.group("value") for match in _NAMED_SECRET.finditer(text)]
    for value in values:
        value = value.strip().strip("\"'[]{}*&!,")
        if value:
            found.add(value)
    return {secret for secret in found if len(secret) >= SHORTEST_SCRUBBED_SECRET}


def _url_passwords(text: str, *, whole_value: bool = False) -> list[str]:
    passwords = []
    for run in [text] if whole_value else _RUN.findall(text):
        scheme_end, at = run.find("://"), run.rfind("@")
        if 0 <= scheme_end < at:
            user, colon, password = run[scheme_end + 3 : at].partition(":")
            typed = password if colon else user
            # As typed, and as the server is given it (percent-decoded).
            passwords += [typed, unquote(typed)]
    return [password for password in passwords if password]


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with each of `secrets` and every recognisable secret replaced by `***`."""
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return redact_text(text)


class RedactingFilter(logging.Filter):
    """A handler filter that blanks recognisable secrets in each record's message."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted_message = redact_text(message)
        if redacted_message != message:
            record.msg, record.args = redacted_message, None
        if record.exc_info and not record.exc_text:
            # Formatted here so the formatter uses this text, not its own.
            record.exc_text = redact_text(_traceback_formatter.formatException(record.exc_info))
        return True


_traceback_formatter = logging.Formatter()

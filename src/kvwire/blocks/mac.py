"""An optional keyed MAC over stored entries, so that a forged entry is a load error.

The xxh3 checksum in every entry's header catches corruption, not forgery:
anyone who may write the directory or the Redis server can store KV with a
valid checksum, and the engine would use it. With a MAC key, every entry is
sealed with HMAC-SHA256 over its header and payload, and an entry whose MAC
does not match (forged, or written without the key) is never loaded.

The key comes only from an environment variable that the profile names
(`mac_key_env`), never from the profile itself; it never appears in a
repr, a log line or an error. HMAC-SHA256 rather than keyed BLAKE2b: where
the CPU has SHA instructions it is the faster of the two (`--only mac`,
docs/performance.md), and both release the GIL while they hash, so I/O
threads seal and verify in parallel.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Mapping

from kvwire.exceptions import MacKeyError as MacKeyError

# The MAC's size in the entry header.
MAC_SIZE = 32
# A key shorter than this would be guessable long before SHA-256 is the limit.
MIN_KEY_BYTES = 32
ALGORITHM = "hmac-sha256"
# Uppercase only, as environment variable names are by convention: a key
# (hex, base64) put here by mistake is then refused without being echoed.
# Bounded, as the name is quoted in errors and in the MAC's repr.
MAX_VARIABLE_NAME = 128
_VARIABLE_NAME = re.compile(rf"[A-Z_][A-Z0-9_]{{0,{MAX_VARIABLE_NAME - 1}}}")


class EntryMac:
    """HMAC-SHA256 with a secret key, for sealing and checking stored entries.

    `key_id` names the key without revealing it (an HMAC of a constant
    under it): entries sealed with another key are stored under other names,
    so engines with different keys miss each other's entries instead of
    discarding them as forged. `variable` is where the key came from; it
    is all that a repr shows.
    """

    __slots__ = ("_sealer", "key_id", "variable")

    def __init__(self, key: bytes, variable: str) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise MacKeyError(
                f"environment variable {variable!r} holds a MAC key shorter than "
                f"{MIN_KEY_BYTES} bytes; {_HOW_TO_SET}"
            )
        # Copied for each entry: the key's padding is hashed once, here.
        self._sealer = hmac.new(key, digestmod=hashlib.sha256)
        self.key_id = hmac.new(key, b"kvwire key id", hashlib.sha256).hexdigest()[:16]
        self.variable = variable

    @classmethod
    def from_environment(
        cls, variable: object, environment: Mapping[str, str] = os.environ
    ) -> EntryMac:
        """The MAC keyed with the bytes of `environment[variable]`.

        The bytes as the environment holds them: Python decodes them with
        `surrogateescape`, so a key that is not UTF-8 is taken as it is,
        never refused with an error that would quote it.
        """
        if not isinstance(variable, str) or not _VARIABLE_NAME.fullmatch(variable):
            # Never echoed: a user who put the key itself here must not see it printed.
            raise MacKeyError(
                "expected the name of an environment variable holding the MAC key (uppercase "
                f"letters, digits and underscores, at most {MAX_VARIABLE_NAME} characters, e.g. "
                "KVWIRE_MAC_KEY), never the key itself"
            )
        value = environment.get(variable)
        if value is None:
            raise MacKeyError(f"environment variable {variable!r} is not set; {_HOW_TO_SET}")
        if not value:
            raise MacKeyError(f"environment variable {variable!r} is empty; {_HOW_TO_SET}")
        return cls(value.encode("utf-8", "surrogateescape"), variable)

    def seal(self, header: memoryview, *payload: memoryview) -> bytes:
        """The MAC of `header` then the `payload` parts, read where they lie."""
        mac = self._sealer.copy()
        mac.update(header)
        for part in payload:
            mac.update(part)
        return mac.digest()

    def matches(self, stored: memoryview, header: memoryview, *payload: memoryview) -> bool:
        """Whether `stored` is the MAC of `header` then `payload` (in constant time)."""
        return hmac.compare_digest(stored, self.seal(header, *payload))

    def __repr__(self) -> str:
        return f"EntryMac({ALGORITHM}, key id {self.key_id}, key from ${self.variable})"


_HOW_TO_SET = (
    f"set it to a secret of at least {MIN_KEY_BYTES} bytes (e.g. `openssl rand -hex 32`), "
    "the same on every engine that shares the store"
)

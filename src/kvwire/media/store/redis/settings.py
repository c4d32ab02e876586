"""Settings of the Redis/Valkey block store, read from `kv_connector_extra_config`.

Every key is validated up front, and every problem is reported at once, by
its dotted name (`kv_connector_extra_config.ttl_seconds`) with what would
be accepted. Passwords are never echoed: they are kept out of reprs, and
`RedisStoreSettings.redact` blanks them in any text meant for a person.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, urlparse

import attrs
import redis
from redis.cluster import ClusterNode

from kvwire.common.redaction import scrub, shown
from kvwire.config.extra_config import finite_seconds, parse_size, seconds_accepted
from kvwire.config.memory_limits import describe_bytes, memory_shortfall
from kvwire.exceptions import RedisSettingsError as RedisSettingsError
from kvwire.media.store.redis._cluster_url import (
    ClusterSeed,
    cluster_credentials,
    cluster_seeds,
    cluster_url_problems,
    has_hash_tag,
    is_cluster_url,
)

EXTRA_CONFIG = "kv_connector_extra_config"
_SCHEMES = ("redis", "rediss", "unix")
_URL_QUERY_KEYS = ("db", "username", "password")


@attrs.frozen(kw_only=True)
class RedisStoreSettings:
    """Where the Redis/Valkey server is and how the store talks to it.

    Built from `kv_connector_extra_config` by `from_extra_config`,
    which validates every key. `password` is kept out of the repr; use
    `display_url` and `redact` for anything shown to a person. All
    attributes are read-only.
    """

    url: str = attrs.field(default="redis://127.0.0.1:6379/0", repr=lambda url: shown(scrub(url)))
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    db: int | None = None
    key_prefix: str = "kvwire:"
    ttl_seconds: int | None = None
    pool_size: int = 8
    socket_timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    load_timeout_s: float = 20.0
    save_timeout_s: float = 30.0
    lookup_timeout_s: float = 1.0
    pipeline_bytes: int = 64 * 1024 * 1024
    lookup_batch_size: int = 64
    retry_interval_s: float = 1.0
    warning_interval_s: float = 30.0
    tls_ca_certs: str | None = None
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    tls_verify: bool = True

    @classmethod
    def extra_config_keys(cls) -> tuple[str, ...]:
        """The `kv_connector_extra_config` keys these settings read."""
        return (*(field.name for field in attrs.fields(cls)), "password_env")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> RedisStoreSettings:
        """Validate the Redis keys of `extra` (others are left to the caller).

        Raises `kvwire.exceptions.RedisSettingsError` listing every bad key.
        """
        problems: list[str] = []
        values: dict[str, Any] = {}
        for field in attrs.fields(cls):
            if field.name not in extra:
                continue
            value = extra[field.name]
            problem = _check_value(field.name, value, field.default)
            if problem:
                problems.append(
                    f"{EXTRA_CONFIG}.{field.name}: {problem}, got {shown(value, key=field.name)}"
                )
            else:
                values[field.name] = _converted(field.name, value)
        password_env = extra.get("password_env")
        if password_env is not None:
            if not isinstance(password_env, str) or not password_env:
                problems.append(
                    f"{EXTRA_CONFIG}.password_env: expected the name of an environment "
                    f"variable holding the password, got {shown(password_env)}"
                )
            elif "password" in extra:
                problems.append(
                    f"{EXTRA_CONFIG}.password_env: give either password or password_env, not both"
                )
            elif password_env not in os.environ:
                problems.append(
                    f"{EXTRA_CONFIG}.password_env: environment variable {shown(password_env)} "
                    "is not set"
                )
            else:
                values["password"] = os.environ[password_env]
        if "url" in values:
            problems.extend(_url_problems(values["url"], explicit_db="db" in values))
            if is_cluster_url(values["url"]) and has_hash_tag(values.get("key_prefix", "")):
                problems.append(
                    f"{EXTRA_CONFIG}.key_prefix: a {{hash tag}} would put every block in one "
                    "slot, on one master; use a prefix without a {...} pair, "
                    f"got {shown(values['key_prefix'])}"
                )
        problems.extend(_tls_problems(values))
        if problems:
            raise RedisSettingsError("invalid Redis settings:\n  " + "\n  ".join(problems))
        return cls(**values)

    @property
    def is_cluster(self) -> bool:
        """True for a `redis+cluster://` URL: keys are spread over the cluster's masters."""
        return is_cluster_url(self.url)

    @property
    def cluster_seeds(self) -> list[ClusterSeed]:
        """The nodes a cluster URL names (empty for a single server)."""
        return cluster_seeds(self.url) if self.is_cluster else []

    def node_settings(self, host: str, port: int) -> RedisStoreSettings:
        """These settings for one cluster node: its own URL, the cluster URL's credentials."""
        scheme = "rediss" if self.url.startswith("rediss") else "redis"
        url_username, url_password = cluster_credentials(self.url)
        username = self.username if self.username is not None else url_username
        password = self.password if self.password is not None else url_password
        return attrs.evolve(
            self, url=f"{scheme}://{host}:{port}/0", username=username, password=password
        )

    @property
    def display_url(self) -> str:
        """The URL with any password replaced by `***`: safe to log."""
        return self.redact(self.url)

    def redact(self, text: str) -> str:
        """`text` with every password these settings know of replaced by `***`."""
        secrets = _url_secrets(self.url)
        if self.password:
            secrets.append(self.password)
        return scrub(text, secrets)

    def connection_pool_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `redis.BlockingConnectionPool`: URL first, explicit keys win."""
        kwargs: dict[str, Any] = redis.connection.parse_url(self.url)  # type: ignore[no-untyped-call]
        kwargs.update(
            max_connections=self.pool_size,
            # How long a thread waits for a free pooled connection.
            timeout=self.socket_timeout_s,
            socket_timeout=self.socket_timeout_s,
            socket_connect_timeout=self.connect_timeout_s,
            # RESP2: the store reads GET replies itself (see redis_wire).
            protocol=2,
        )
        for name in ("username", "password", "db"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.url.startswith("rediss://"):
            kwargs.update(self._tls_kwargs())
        return kwargs

    def cluster_client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for redis-py's `RedisCluster`: seeds, timeouts, credentials, TLS."""
        seed = self.cluster_seeds[0]
        # The credentials every node is given: explicit keys, else the URL's.
        node = self.node_settings(seed.host, seed.port)
        kwargs: dict[str, Any] = {
            "startup_nodes": [
                ClusterNode(seed.host, seed.port)  # type: ignore[no-untyped-call]
                for seed in self.cluster_seeds
            ],
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.connect_timeout_s,
            "protocol": 2,
            # Slots without a master (mid-failover) are misses, not an error.
            "require_full_coverage": False,
            "username": node.username,
            "password": node.password,
        }
        if self.url.startswith("rediss"):
            kwargs.update(ssl=True, **self._tls_kwargs())
        return kwargs

    def _tls_kwargs(self) -> dict[str, Any]:
        """redis-py's TLS arguments, the same for one server's pool and a cluster's nodes."""
        return {
            "ssl_ca_certs": self.tls_ca_certs,
            "ssl_certfile": self.tls_certfile,
            "ssl_keyfile": self.tls_keyfile,
            "ssl_cert_reqs": "required" if self.tls_verify else "none",
            "ssl_check_hostname": self.tls_verify,
        }


_HOUR = 3600
# The bound of each duration: a deadline or interval past it is a mistake, and
# an infinite or huge one overflows the socket calls and deadlines it sets.
_MOST_SECONDS: dict[str, int] = {
    "ttl_seconds": 3650 * 24 * _HOUR,
    "socket_timeout_s": _HOUR,
    "connect_timeout_s": _HOUR,
    "load_timeout_s": _HOUR,
    "save_timeout_s": _HOUR,
    "lookup_timeout_s": _HOUR,
    "retry_interval_s": _HOUR,
    "warning_interval_s": 24 * _HOUR,
}
# Durations that may be 0 (a warning each time), and those that are whole seconds.
_ZERO_SECONDS = frozenset({"warning_interval_s"})
_WHOLE_SECONDS = frozenset({"ttl_seconds"})


def _seconds(name: str) -> str:
    return seconds_accepted(
        _MOST_SECONDS[name], zero=name in _ZERO_SECONDS, whole=name in _WHOLE_SECONDS
    )


_EXPECTED: dict[str, str] = {
    "url": (
        "a redis://, rediss:// or unix:// URL, or redis+cluster:// (rediss+cluster://) "
        "with a cluster's seed nodes"
    ),
    "username": "an ACL user name (string) or null",
    "password": "a string or null",
    "db": "a database number >= 0 or null",
    "key_prefix": "a string",
    "ttl_seconds": (f"{_seconds('ttl_seconds')}, restarted by every load, or null for no expiry"),
    "pool_size": "a whole number of connections > 0",
    "socket_timeout_s": _seconds("socket_timeout_s"),
    "connect_timeout_s": _seconds("connect_timeout_s"),
    "load_timeout_s": (
        f"{_seconds('load_timeout_s')} that one load (a run of blocks) may take in all"
    ),
    "save_timeout_s": (
        f"{_seconds('save_timeout_s')} that one save (a run of blocks) may take in all"
    ),
    "lookup_timeout_s": (
        f"{_seconds('lookup_timeout_s')} that one lookup (or directory call, delete, probe, "
        "clear step) may take in all"
    ),
    "pipeline_bytes": (
        'a byte count per save/load pipeline > 0, as an int or a string such as "64MiB"'
    ),
    "lookup_batch_size": "a whole number of keys per lookup pipeline > 0",
    "retry_interval_s": _seconds("retry_interval_s"),
    "warning_interval_s": _seconds("warning_interval_s"),
    "tls_ca_certs": "a file path or null",
    "tls_certfile": "a file path or null",
    "tls_keyfile": "a file path or null",
    "tls_verify": "true or false",
}


def _check_value(name: str, value: Any, default: Any) -> str | None:
    """None when `value` is acceptable for `name`, else what would be."""
    expected = f"expected {_EXPECTED[name]}"
    if value is None:
        return None if default is None and name != "url" else expected
    if name == "tls_verify":
        return None if isinstance(value, bool) else expected
    if isinstance(value, bool):
        return expected
    if name in _MOST_SECONDS:
        seconds = finite_seconds(
            value,
            _MOST_SECONDS[name],
            zero=name in _ZERO_SECONDS,
            whole=name in _WHOLE_SECONDS,
        )
        return None if seconds is not None else expected
    if name == "pipeline_bytes":
        # The same forms as the connector's other sizes (max_save_bytes_in_flight).
        size = parse_size(value)
        if size is None or size <= 0:
            return expected
        # A pipeline's values are held in memory until they are sent or read.
        shortfall = memory_shortfall(size)
        return f"{describe_bytes(size)} would be held in memory, {shortfall}" if shortfall else None
    if isinstance(default, int) or name == "db":
        if not isinstance(value, int):
            return expected
        return None if (value >= 0 if name == "db" else value > 0) else expected
    return None if isinstance(value, str) else expected


def _converted(name: str, value: Any) -> Any:
    """An accepted `value` as its field holds it: seconds as floats, sizes in bytes."""
    if name.endswith("_s"):
        return float(value)
    if name == "pipeline_bytes":
        return parse_size(value)
    return value


def _url_problems(url: str, *, explicit_db: bool) -> list[str]:
    where = f"{EXTRA_CONFIG}.url"
    if is_cluster_url(url):
        problems = cluster_url_problems(url, where)
        if explicit_db:
            problems.append(f"{EXTRA_CONFIG}.db: a cluster has only database 0; leave db out")
        return problems
    try:
        parsed = urlparse(url)
    except ValueError:  # an unbalanced '[' or ']' ("Invalid IPv6 URL")
        # Nothing of the URL is quoted: it may hold the password.
        return [
            f"{where}: an IPv6 host goes between '[' and ']' (redis://[::1]:6379/0), and "
            "nothing else of the URL may hold them unless percent-encoded (%5B, %5D)"
        ]
    if parsed.scheme not in _SCHEMES:
        return [
            f"{where}: scheme must be one of redis://, rediss://, unix://, redis+cluster://, "
            f"rediss+cluster://, got {shown(parsed.scheme)}"
        ]
    if "@" in url.partition("://")[2] and "@" not in parsed.netloc:
        # An '@' past the host: a password holding '/', '?' or '#' ends the
        # host part early, and the rest of the password reads as a path.
        # Nothing of the URL is quoted: it holds the password.
        return [
            f"{where}: the user name or password holds '/', '?' or '#'; percent-encode them "
            "(%2F, %3F, %23), or give the password as password_env"
        ]
    problems = []
    query = parse_qs(parsed.query)
    unknown = sorted(set(query) - set(_URL_QUERY_KEYS))
    if unknown:
        problems.append(
            f"{where}: query option(s) {', '.join(unknown)} are not accepted "
            f"(only {', '.join(_URL_QUERY_KEYS)}; the rest are kv_connector_extra_config keys)"
        )
    if parsed.scheme == "unix" and not parsed.path:
        problems.append(
            f"{where}: a unix:// URL needs the socket path, e.g. unix:///run/redis.sock"
        )
    if parsed.scheme != "unix":
        if not parsed.hostname:
            problems.append(f"{where}: no host, e.g. redis://cache.internal:6379/0")
        try:
            parsed.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError:
            problems.append(f"{where}: the port must be a number between 0 and 65535")
        url_db = parsed.path.strip("/")
        if url_db and not url_db.isdigit():
            problems.append(f"{where}: the path must be a database number, got {shown(url_db)}")
        if explicit_db and (url_db or "db" in query):
            problems.append(f"{where}: names a database and so does {EXTRA_CONFIG}.db; keep one")
    return problems


def _url_secrets(url: str) -> list[str]:
    if is_cluster_url(url):
        return [secret for secret in cluster_credentials(url)[1:] if secret]
    try:
        parsed = urlparse(url)
        found = [parsed.password, *parse_qs(parsed.query).get("password", [])]
    except ValueError:  # malformed, and refused by the check: blank the part urllib would
        found = [url.partition("://")[2].partition("/")[0].rpartition("@")[0].partition(":")[2]]
    return [secret for secret in found if secret]


def _tls_problems(values: Mapping[str, Any]) -> list[str]:
    problems = []
    uses_tls = str(values.get("url", "")).startswith(("rediss://", "rediss+cluster://"))
    for name in ("tls_ca_certs", "tls_certfile", "tls_keyfile"):
        path = values.get(name)
        if path is None:
            continue
        if not uses_tls:
            problems.append(
                f"{EXTRA_CONFIG}.{name}: only used with a rediss:// url (or rediss+cluster://)"
            )
        elif not os.path.isfile(path):
            problems.append(f"{EXTRA_CONFIG}.{name}: no file at {shown(path)}; expected a PEM file")
    return problems

"""`redis+cluster://` URLs: the seed nodes of a Redis Cluster (or Valkey cluster).

`redis+cluster://[user:password@]host:port[,host:port...]` (`rediss+cluster://`
for TLS) names one or more nodes of a cluster (an IPv6 address in brackets,
`[::1]:7000`); the credentials, once, come before the first. Any one that answers is
enough: the store asks it for the slot map (`CLUSTER SLOTS`, through
redis-py's `RedisCluster`) and finds every master from there, so a few seeds
on different machines let the store start while some are down. A cluster
has only database 0, so the URL names no other.

The seeds and credentials are parsed here by hand: `urllib.parse` reads one
host per URL, and would take what precedes the last '@' of all the seeds for
the credentials.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import unquote

import attrs

from kvwire.common.redaction import shown

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
# A DNS name or an IPv4 address (underscores too: some internal names hold them).
_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")


@attrs.frozen
class ClusterSeed:
    """One node named by a cluster URL."""

    host: str
    port: int


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0] in CLUSTER_SCHEMES


def has_hash_tag(key_prefix: str) -> bool:
    """Whether keys under `key_prefix` would all hash by a `{tag}` (one slot for them all).

    Redis Cluster hashes only what lies between the first `{` and the next
    `}` when that is not empty.
    """
    start = key_prefix.find("{")
    end = key_prefix.find("}", start + 1)
    return start != -1 and end > start + 1


def cluster_url_problems(url: str, where: str) -> list[str]:
    """What is wrong with a `redis+cluster://` URL, each naming `where`; none if it is good."""
    _, _, rest = url.partition("://")
    if _credentials_run_past_the_authority(rest):
        # Quoting any seed would quote a piece of the password.
        return [
            f"{where}: the user name or password holds a '/', '?' or '#', which ends the "
            "seeds' part of a URL; percent-encode it (%2F, %3F, %23)"
        ]
    hosts, _, path = _after_credentials(rest).partition("/")
    problems = []
    path, _, query = path.partition("?")
    if "?" in hosts:
        hosts, _, query = hosts.partition("?")
    if path.strip("/") not in ("", "0") or "db=" in query:
        problems.append(f"{where}: a cluster has only database 0; name no other")
    elif query:
        problems.append(
            f"{where}: a cluster URL takes no query options; give them as "
            "kv_connector_extra_config keys"
        )
    if "," in _credentials(rest):
        # Quoting anything before the '@' would quote the password.
        problems.append(
            f"{where}: the credentials go once, right after the scheme and before the first "
            "seed (user:password@host:port,host:port); a ',' before the '@' puts them after a "
            "seed, or is a ',' in the user name or password, which must be percent-encoded "
            "(%2C)"
        )
        return problems
    if not hosts:
        problems.append(f"{where}: no seed node, e.g. redis+cluster://10.0.0.1:7000,10.0.0.2:7000")
    for seed in hosts.split(",") if hosts else []:
        problem = _seed_problem(seed)
        if problem is not None:
            problems.append(f"{where}: seed {shown(seed)}{problem}")
    return problems


def cluster_seeds(url: str) -> list[ClusterSeed]:
    """The seed nodes of a valid cluster URL, in the order given."""
    _, _, rest = url.partition("://")
    hosts = _after_credentials(rest).partition("/")[0].partition("?")[0]
    seeds = []
    for seed in hosts.split(","):
        host, _, port = seed.rpartition(":")
        seeds.append(ClusterSeed(host.removeprefix("[").removesuffix("]"), int(port)))
    return seeds


def cluster_credentials(url: str) -> tuple[str | None, str | None]:
    """The user name and password of a valid cluster URL (percent-decoded); None where absent.

    Read by hand, as the seeds are: `urllib.parse` would take everything
    before the last '@' of all the seeds for them.
    """
    credentials = _credentials(url.partition("://")[2])
    if not credentials:
        return None, None
    user, colon, password = credentials.partition(":")
    return unquote(user) or None, unquote(password) if colon and password else None


def _seed_problem(seed: str) -> str | None:
    """What is wrong with one `host:port` seed (`[v6 address]:port` for IPv6), to follow
    the seed in a message; None if it is good."""
    if seed.startswith("["):
        close = seed.find("]")
        if close < 0:
            return " opens an IPv6 address with '[' and never closes it; write it as [::1]:7000"
        host, port = seed[1:close], seed[close + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return " holds no IPv6 address between '[' and ']', e.g. [::1]:7000"
        if not port.startswith(":"):
            return " must be [IPv6 address]:port, e.g. [::1]:7000"
        port = port[1:]
    else:
        host, colon, port = seed.rpartition(":")
        if not colon or not host:
            return " must be host:port"
        if ":" in host:
            return " is an IPv6 address without brackets; write it as [::1]:7000"
        if not _HOST_NAME.fullmatch(host):
            return " must be host:port, the host a name or an IPv4 address"
    # ASCII digits only: int() also reads '٣' and refuses '²', both isdigit().
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return ": the port must be a number between 1 and 65535"
    return None


def _credentials_run_past_the_authority(rest: str) -> bool:
    """Whether an '@' comes after the '/', '?' or '#' that ends a URL's authority.

    urllib (which reads the credentials each node is given) ends the
    authority there, so the credentials it would read are not those typed.
    """
    ends = [index for index in (rest.find(mark) for mark in "/?#") if index >= 0]
    return "@" in rest[min(ends, default=len(rest)) :]


def _after_credentials(rest: str) -> str:
    # The last '@' before the path ends the credentials: a password may hold one.
    authority = rest.partition("/")[0]
    return rest[authority.rfind("@") + 1 :]


def _credentials(rest: str) -> str:
    """What comes before the last '@' of the authority: `user:password`, or ""."""
    authority = rest.partition("/")[0]
    return authority[: max(authority.rfind("@"), 0)]

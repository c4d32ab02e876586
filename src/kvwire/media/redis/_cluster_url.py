"""``redis+cluster://`` URLs: the seed nodes of a Redis Cluster (or Valkey cluster).

``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster://``
for TLS) names one or more nodes of a cluster. Any one that answers is
enough: the store asks it for the slot map (``CLUSTER SLOTS``, through
redis-py's ``RedisCluster``) and finds every master from there, so a few seeds
on different machines let the store start while some are down. A cluster
has only database 0, so the URL names no other.

The seeds are parsed here by hand: ``urllib.parse`` reads one host per URL.
"""

from __future__ import annotations

import attrs

from kvwire.redaction import shown

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


@attrs.frozen
class ClusterSeed:
    """One node named by a cluster URL."""

    host: str
    port: int


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0] in CLUSTER_SCHEMES


def has_hash_tag(key_prefix: str) -> bool:
    """Whether keys under ``key_prefix`` would all hash by a ``{tag}`` (one slot for them all).

    Redis Cluster hashes only what lies between the first ``{`` and the next
    ``}`` when that is not empty.
    """
    start = key_prefix.find("{")
    end = key_prefix.find("}", start + 1)
    return start != -1 and end > start + 1


def cluster_url_problems(url: str, where: str) -> list[str]:
    """What is wrong with a ``redis+cluster://`` URL, each naming ``where``; none if it is good."""
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
    if not hosts:
        problems.append(f"{where}: no seed node, e.g. redis+cluster://10.0.0.1:7000,10.0.0.2:7000")
    for seed in hosts.split(",") if hosts else []:
        host, colon, port = seed.rpartition(":")
        if not colon or not host:
            problems.append(f"{where}: seed {shown(seed)} must be host:port")
        # ASCII digits only: int() also reads '٣' and refuses '²', both isdigit().
        elif not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            problems.append(
                f"{where}: seed {shown(seed)}: the port must be a number between 1 and 65535"
            )
    return problems


def cluster_seeds(url: str) -> list[ClusterSeed]:
    """The seed nodes of a valid cluster URL, in the order given."""
    _, _, rest = url.partition("://")
    hosts = _after_credentials(rest).partition("/")[0].partition("?")[0]
    seeds = []
    for seed in hosts.split(","):
        host, _, port = seed.rpartition(":")
        seeds.append(ClusterSeed(host.strip("[]"), int(port)))
    return seeds


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

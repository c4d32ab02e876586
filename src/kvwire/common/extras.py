"""Which of kvwire's extras provides an optional dependency, so a missing one says what to install.

kvwire's core needs only dependency-injector, attrs, cattrs, PyYAML and xxhash; the
engine and the connectors' data path need the `torch` extra, the Redis
medium the `redis` extra, the peer medium the `peer` extra (pyproject.toml).
Where kvwire first imports one of them (`kvwire run`'s engine, the registries
when they import a connector's or a medium's module), a
`ModuleNotFoundError` for it becomes a
`kvwire.exceptions.MissingExtraError` naming what
needed it and the `pip install` that provides it.
"""

from __future__ import annotations

from kvwire.exceptions import MissingExtraError

EXTRA_OF_MODULE: dict[str, str] = {
    "torch": "torch",
    "numpy": "torch",
    "redis": "redis",
    "hiredis": "redis",
    "nixl": "peer",
    "nixl_cu12": "peer",
}
"""Top-level module -> the extra of kvwire that installs it."""


def missing_extra(error: BaseException, needed_by: str) -> MissingExtraError | None:
    """The error saying which extra to install, when `error` is a missing module one provides.

    `needed_by` names what imported it (`kvwire run`, `medium 'redis'`).
    None for anything else: a missing module no extra provides (a plug-in's
    own dependency, a typo in a module path), or a submodule missing from an
    installed package (a broken install, which no extra fixes).
    """
    if not isinstance(error, ModuleNotFoundError) or not isinstance(error.name, str):
        return None
    extra = EXTRA_OF_MODULE.get(error.name)
    if extra is None:
        return None
    return MissingExtraError(needed_by, error.name, extra)

"""Methods a plug-in overrides that were renamed: the old name works one more release, warned.

A base class whose overridable method got a new name calls only the new
one. A subclass that still overrides only the old name keeps working: its
class statement warns ([`forward_old_overrides`][kvwire._renamed_methods.forward_old_overrides],
from the base's `__init_subclass__`), and its old-named method becomes its
new-named one too. The base keeps the old name as a method that warns and
calls the new one ([`call_renamed`][kvwire._renamed_methods.call_renamed]). CHANGELOG.md says in
which release each old name goes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["call_renamed", "forward_old_overrides"]


def forward_old_overrides(cls: type, renamed: Mapping[str, str]) -> None:
    """For each old name `cls` overrides without the new one: warn, and make it the new one too."""
    for old, new in renamed.items():
        if old in vars(cls) and new not in vars(cls):
            warnings.warn(
                f"{cls.__module__}.{cls.__qualname__}.{old} is deprecated: name it {new}; "
                f"kvwire calls {old} no more from the next release",
                DeprecationWarning,
                stacklevel=3,
            )
            setattr(cls, new, vars(cls)[old])


def call_renamed(
    instance: object, base: type, old: str, new: str, *args: Any, **kwargs: Any
) -> Any:
    """The base's old-named method: warn, then call the new name.

    Where a class of `instance` overrides the old name, this is reached only
    through `super()` from the last such override: it calls the new-named
    method of the first class after it (the base's, at the latest).
    """
    warnings.warn(
        f"{base.__name__}.{old} is deprecated: call {new}; {old} goes in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    cls = type(instance)
    overriding = [i for i, k in enumerate(cls.__mro__) if k is not base and old in vars(k)]
    if not overriding:
        return getattr(instance, new)(*args, **kwargs)
    after = cls.__mro__[overriding[-1] + 1 :]
    method: Callable[..., Any] = next(vars(k)[new] for k in after if new in vars(k))
    return method(instance, *args, **kwargs)

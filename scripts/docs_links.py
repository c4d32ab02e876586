"""A griffe extension for the documentation site: kvwire's names in docstrings become links.

kvwire's docstrings name other objects in plain backticks, fully qualified
(`kvwire.ConnectorRegistry.resolve`), so that `help()` and an editor show
them as they are, with no link markup. For the site, each such name becomes
an optional cross-reference (mkdocs-autorefs): a link where the API
reference renders the object, plain code elsewhere. That every such name
exists is a test's business (tests/package/test_docstring_names.py), not
the site build's.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# A backticked dotted name under `kvwire.`, not already the title of a link.
_NAME = re.compile(r"(?<!\[)`(kvwire(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`(?!\])")


def linked(text: str) -> str:
    """`text` with each backticked kvwire name an optional cross-reference to it."""
    return _NAME.sub(
        lambda name: (
            f'<autoref identifier="{name[1]}" optional><code>{name[1]}</code></autoref>'
        ),
        text,
    )


class KvwireNameLinks(griffe.Extension):
    """Link the backticked kvwire names of every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = linked(obj.docstring.value)

"""Griffe extension for the docs build: read ``Example:`` as a Google examples section.

The house style heads docstring examples ``Example:``; griffe's Google parser only
treats the plural ``Examples:`` as an examples section (it renders the singular as an
admonition, mangling the ``>>>`` lines into Markdown). Rename the header before parsing.
"""

import re
from typing import Any

import griffe

_EXAMPLE_HEADER = re.compile(r"^Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE_HEADER.sub("Examples:", obj.docstring.value)

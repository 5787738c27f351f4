"""mkdocs hooks for the API reference: the docstrings use Sphinx roles (``:class:`~a.B```),
which Markdown shows as they are; drop the role and show ``~a.B`` as ``B``, as Sphinx does."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|mod|func|meth|data|attr|exc|obj|py:\w+):(?=<code>)")
_TILDE = re.compile(r"<code>~(?:[\w.]+\.)?(\w+)</code>")


def on_page_content(html: str, **_: Any) -> str:
    return _TILDE.sub(r"<code>\1</code>", _ROLE.sub("", html))

"""Sphinx extension: the book's links to the recorded chapters (``book/recorded/cpu/``, ``tools/book/record.py``).

- The introduction links each chapter's recorded notebook as a plain relative link, which GitHub's web viewer opens
  in one click. In the book such a link would name a document outside the table of contents (a build error), so it
  becomes a download of that notebook (MyST's ``path:`` links: Sphinx copies the file into ``_downloads/``).
- A chapter's page is made from ``book/generated/<name>.ipynb``, a build product that is not in the repository, so
  the Binder and Colab links sphinx-book-theme builds from the page's path would open nothing. They are pointed at the
  chapter's recorded notebook, which holds the same code cells (``tests/book/test_record.py``). The buttons exist
  only where the build knows its repository (``tools.book.record.launch_config``: a GitHub Actions build); the
  notebook download needs none.
"""
from __future__ import annotations

import re

GENERATED = "book/generated/"
RECORDED = "book/recorded/cpu/"  # tools.book.record.record_dir(), relative to the repository
_RECORDED_LINK = re.compile(r"\]\((recorded/[^)\s]+\.ipynb)\)")  # from book/intro.md


def recorded_url(url: str) -> str:
    """A launch URL naming a generated chapter, naming its recorded notebook instead."""
    return url.replace(GENERATED, RECORDED)


def downloaded_links(text: str) -> str:
    """Markdown whose relative links to recorded notebooks are downloads of them (``path:``)."""
    return _RECORDED_LINK.sub(r"](path:\1)", text)


def _download_recorded_notebooks(app, docname, source) -> None:
    source[0] = downloaded_links(source[0])


def _point_launch_buttons_at_the_record(app, pagename, templatename, context, doctree) -> None:
    for button in context.get("header_buttons", []):
        if button.get("label") == "launch-buttons":
            for link in button.get("buttons", []):
                if "url" in link:
                    link["url"] = recorded_url(link["url"])


def setup(app):
    app.connect("source-read", _download_recorded_notebooks)
    # after sphinx-book-theme's add_launch_buttons (priority 501)
    app.connect("html-page-context", _point_launch_buttons_at_the_record, priority=502)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

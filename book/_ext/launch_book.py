"""Sphinx extension: the chapters' launch buttons open the recorded notebooks.

A chapter's page is made from ``book/generated/<name>.ipynb``, a build product that is not in the repository, so
the Binder and Colab links sphinx-book-theme builds from the page's path would open nothing. They are pointed at
the chapter's recorded notebook, ``book/recorded/cpu/<name>.ipynb`` (tracked; ``tools/book/record.py``), which holds
the same code cells (``tests/book/test_record.py``). The buttons exist only where the build knows its repository
(``tools.book.record.launch_config``: a GitHub Actions build); the notebook download needs none.
"""
from __future__ import annotations

GENERATED = "book/generated/"
RECORDED = "book/recorded/cpu/"  # tools.book.record.record_dir(), relative to the repository


def recorded_url(url: str) -> str:
    """A launch URL naming a generated chapter, naming its recorded notebook instead."""
    return url.replace(GENERATED, RECORDED)


def _point_launch_buttons_at_the_record(app, pagename, templatename, context, doctree) -> None:
    for button in context.get("header_buttons", []):
        if button.get("label") == "launch-buttons":
            for link in button.get("buttons", []):
                if "url" in link:
                    link["url"] = recorded_url(link["url"])


def setup(app):
    # after sphinx-book-theme's add_launch_buttons (priority 501)
    app.connect("html-page-context", _point_launch_buttons_at_the_record, priority=502)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

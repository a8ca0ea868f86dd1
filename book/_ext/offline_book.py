"""Sphinx extension for a book that works offline and loads without console errors.

- sphinx-thebe (enabled unconditionally by Jupyter Book 1.x) injects a script holding a CDN address of the thebe
  bundle, and registers it again on every re-read of the environment, which declares ``const THEBE_JS_URL`` twice
  ("Identifier 'THEBE_JS_URL' has already been declared"). This book has no live-code buttons: drop those scripts.
- Any other script registered twice is kept once.
"""
from __future__ import annotations


def _script_key(script) -> tuple[str, str]:
    attributes = getattr(script, "attributes", {}) or {}
    return str(getattr(script, "filename", script) or ""), str(attributes.get("body", ""))


def _clean_scripts(app, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    kept, seen = [], set()
    for script in scripts:
        filename, body = _script_key(script)
        if "THEBE_JS_URL" in body or filename.endswith("sphinx-thebe.js") or "unpkg.com" in filename:
            continue
        if (filename, body) in seen:
            continue
        seen.add((filename, body))
        kept.append(script)
    context["script_files"] = kept


def setup(app):
    app.connect("html-page-context", _clean_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

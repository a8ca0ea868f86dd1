"""The chapters' back-ends: one module per notebook, named as its notebook (``notebooks/<name>.ipynb`` ->
``companion.chapters.<name>``), which turns results into the chapter's figures, tables and glued sentences.

Shared by the chapters: :mod:`companion.chapters.common` (the page's fonts, saving, provenance notes),
:mod:`companion.chapters.style` (one colour per method) with its colour science :mod:`companion.chapters.colour`, and
:mod:`companion.chapters.coverage` (which chapter regenerates which of the paper's figures and tables: the book's
coverage page). A chapter back-end takes data and results; what must be trained or loaded first it asks
:mod:`companion.experiments` for (the compression chapter's pruning study, run in place at the chapter's scale, is the
one measurement made here). Nothing below this room imports it (``ARCHITECTURE.md``), so a change here re-runs no
training or evaluation job.
"""

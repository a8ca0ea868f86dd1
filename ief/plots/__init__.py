"""Figures and tables of the book, one module per chapter group (``toy``, ``theory``, ``train``, ``setups``, ...).

The notebooks call these; the core math modules of ``ief`` never plot. Shared helpers (style, saving, provenance
notes) are in :mod:`ief.plots.common`.
"""

"""``python -m tools.book``: the book's command line (:mod:`tools.book.cli`)."""
import sys

from tools.book.cli import main

sys.exit(main())

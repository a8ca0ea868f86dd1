"""The built smoke-scale book, opened in a real browser (Debian's Chromium driven by Playwright).

Run alone with ``pytest -m browser``. The book is built by ``make test`` (``python -m tools.book --scale smoke
--output _build/smoke``); if it is missing, the fixture builds it. Served from a loopback HTTP server (fonts and
MathJax components load as they would for a reader). For every page: no console error, every ``<img>`` decoded
(non-zero natural width), every internal link resolves to a file, math typeset by MathJax where the page has math,
and the navigation lists every chapter of ``_toc.yml``. As a reader meets each page of ``_toc.yml``: no raw TeX in
visible text (math MathJax never typeset) and no MathJax error, no raw ``\\label`` key of the paper outside code
listings, at most 2 visible code inputs, every image shown at >= 50 % of its natural width or enlarged on click
(checked by clicking), and every figure's smallest text >= 9 px as shown, with a note under a reduced one.
Full-page screenshots of every page are kept under ``_build/screenshots/`` to look at.

``IEF_BOOK=D`` tests the book built in ``D/_build/html`` instead (e.g. the book from the record:
``make book FROM=record BOOK_OUTPUT=_build/record``, then ``IEF_BOOK=_build/record pytest -m browser ...``).
"""
from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BOOK = Path(os.environ["IEF_BOOK"]).resolve() if os.environ.get("IEF_BOOK") else ROOT / "_build" / "smoke"
HTML = BOOK / "_build" / "html"
SCREENSHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

pytestmark = pytest.mark.browser


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [c["file"] for c in part.get("chapters", [])]
    files += [c["file"] for c in toc.get("chapters", [])]
    return files


@pytest.fixture(scope="module")
def book() -> Path:
    if not (HTML / "index.html").exists():
        assert not os.environ.get("IEF_BOOK"), f"IEF_BOOK names no built book: {HTML / 'index.html'} is missing"
        from tools.book.cli import main

        assert main(["--scale", "smoke", "--output", str(BOOK)]) == 0, "building the smoke book failed"
    return HTML


@pytest.fixture(scope="module")
def server(book):
    handler = functools.partial(_QuietHandler, directory=str(book))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: install Debian's package (apt-get install chromium); "
                    "`make test` does this")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-quic"],
        )
        yield b
        b.close()


def pages(html: Path) -> list[str]:
    return sorted(str(p.relative_to(html)) for p in html.rglob("*.html") if "_static" not in p.parts)


def test_every_page_loads_cleanly(book, server, browser):
    html = book
    all_pages = pages(html)
    assert any(p.startswith("book/") for p in all_pages), all_pages
    problems: list[str] = []
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    for rel in all_pages:
        errors.clear()
        url = urljoin(server, rel)
        page.goto(url, wait_until="networkidle")  # index.html redirects to the root chapter
        has_math = page.evaluate("document.querySelectorAll('.math, span.math, div.math').length") > 0
        if has_math:
            try:
                page.wait_for_selector("mjx-container", state="attached", timeout=15000)
            except Exception:  # noqa: BLE001 - reported below
                problems.append(f"{rel}: math present but not typeset by MathJax")
        base = page.url  # after the redirect of index.html
        broken_images = page.evaluate(
            "Array.from(document.images).filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)"
        )
        problems += [f"{rel}: image not rendered: {src}" for src in broken_images]
        for href in page.evaluate("Array.from(document.querySelectorAll('a[href]')).map(a => a.getAttribute('href'))"):
            target = urlparse(urljoin(base, href))
            if target.scheme not in ("http", "https") or target.netloc != urlparse(server).netloc:
                continue  # external links are allowed in prose (the book loads nothing from them)
            path = html / unquote(target.path).lstrip("/")
            if path.is_dir():
                path = path / "index.html"
            if not path.exists():
                problems.append(f"{rel}: internal link {href!r} does not resolve")
        problems += [f"{rel}: console error: {e}" for e in errors]
    page.close()
    assert not problems, "\n".join(problems)


def test_nothing_is_loaded_from_the_internet(book, server, browser):
    page = browser.new_page()
    remote: list[str] = []
    page.on("request", lambda req: remote.append(req.url) if not req.url.startswith(server) else None)
    for rel in pages(book):
        page.goto(urljoin(server, rel), wait_until="networkidle")
    page.close()
    assert not [u for u in remote if not u.startswith("data:")], remote


def test_navigation_lists_every_chapter_and_screenshots(book, server, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    files = toc_files()
    for current in (files[0], files[-1]):  # on each page, the other pages are links in the navigation
        page.goto(urljoin(server, current + ".html"), wait_until="networkidle")
        nav = page.evaluate("Array.from(document.querySelectorAll('.bd-sidebar-primary a[href]')).map(a => a.href)")
        missing = [f for f in files if f != current and not any(h.split("#")[0].endswith(f + ".html") for h in nav)]
        assert not missing, f"chapters missing from the navigation of {current}: {missing}"
    page.goto(urljoin(server, files[0] + ".html"), wait_until="networkidle")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "intro.png"), full_page=False)
    figure_pages = [f for f in toc_files() if f.startswith("book/generated/")]
    if figure_pages:
        page.goto(urljoin(server, figure_pages[0] + ".html"), wait_until="networkidle")
        page.wait_for_selector("img", timeout=15000)
        page.locator("img").first.scroll_into_view_if_needed()
        page.screenshot(path=str(SCREENSHOTS / "figure-chapter.png"), full_page=False)
        assert (SCREENSHOTS / "figure-chapter.png").stat().st_size > 10_000
    page.close()
    assert (SCREENSHOTS / "intro.png").stat().st_size > 10_000


# ------------------------------------------------------------------------------------------ the page as a reader
# TeX a reader must never see as text: MathJax replaces every math node by an <mjx-container>, so any of these left
# in a visible text node outside MathJax's output is math that was never typeset.
RAW_TEX = (r"\$\$|\\\(|\\\)|\\\[|\\\]"
           r"|\\(?:mathbf|mathcal|boldsymbol|frac|nabla|theta|lambda|text|left|right|sum|tilde)\b")
VISIBLE_TEXT_JS = """() => {
  const root = document.querySelector('main') || document.body;
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  const out = [];
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const el = node.parentElement;
    if (!el || el.closest('mjx-container, script, style, noscript, .MathJax')) continue;
    if (!el.checkVisibility({checkOpacity: true, checkVisibilityCSS: true})) continue;
    const text = node.textContent.trim();
    // code listings are code (their comments cite labels by the project's convention): marked and exempt
    if (text) out.push(el.closest('pre') ? '\u0000code\u0000' + text : text);
  }
  return out;
}"""


def _chapter_pages() -> list[str]:
    return [f + ".html" for f in toc_files()]


def test_reader_sees_no_raw_tex_and_no_raw_label_keys(book, server, browser):
    import re

    from companion.paper import labels

    keys = re.compile(r"\b(?:" + "|".join(re.escape(k) for k in sorted(labels(), key=len, reverse=True)) + r")\b")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems = []
    for rel in _chapter_pages():
        page.goto(urljoin(server, rel), wait_until="networkidle")
        if page.evaluate("document.querySelectorAll('.math').length") > 0:
            page.wait_for_selector("mjx-container", state="attached", timeout=15000)
            page.wait_for_timeout(300)
        errors = page.evaluate("Array.from(document.querySelectorAll('mjx-merror')).map(e => e.textContent)")
        problems += [f"{rel}: MathJax could not typeset: {e[:120]!r}" for e in errors]
        for text in page.evaluate(VISIBLE_TEXT_JS):
            if re.search(RAW_TEX, text) and not text.startswith("\x00code\x00"):
                problems.append(f"{rel}: raw TeX in visible text: {text[:120]!r}")
            if keys.search(text.split("\x00code\x00")[0]):
                problems.append(f"{rel}: raw label key in visible text: {text[:120]!r}")
    page.close()
    assert not problems, "\n".join(problems)


def test_at_most_two_visible_code_inputs_per_chapter(book, server, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    counts = {}
    for rel in _chapter_pages():
        page.goto(urljoin(server, rel), wait_until="networkidle")
        counts[rel] = page.evaluate(
            "Array.from(document.querySelectorAll('div.cell_input')).filter(e => e.checkVisibility()).length")
    page.close()
    assert counts and all(n <= 2 for n in counts.values()), counts


def test_every_figure_is_legible_or_enlarges_and_screenshots(book, server, browser):
    """Every image is shown at >= 50 % of its natural width or enlarges on click (checked by clicking it); a full
    screenshot of every page is kept in _build/screenshots/ for a reader to look at."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    problems, enlarged = [], 0
    for rel in _chapter_pages():
        page.goto(urljoin(server, rel), wait_until="networkidle")
        if page.evaluate("document.querySelectorAll('.math').length") > 0:
            page.wait_for_selector("mjx-container", state="attached", timeout=15000)
        images = page.evaluate("""Array.from(document.querySelectorAll('main img')).map((img, i) => ({i: i,
            src: img.getAttribute('src'), shown: img.getBoundingClientRect().width, natural: img.naturalWidth,
            enlargeable: img.classList.contains('enlargeable')}))""")
        for img in images:
            if img["shown"] >= 0.5 * img["natural"]:
                continue
            if not img["enlargeable"]:
                problems.append(f"{rel}: {img['src']} shown at {img['shown']:.0f} of {img['natural']} px, no enlarge")
                continue
            locator = page.locator("main img").nth(img["i"])
            locator.scroll_into_view_if_needed()
            locator.click()
            big = page.evaluate("""(() => { const o = document.getElementById('enlarge-overlay');
                const b = o && o.querySelector('img'); return o && o.classList.contains('open') && b ?
                b.getBoundingClientRect().width : 0; })()""")
            if big < 0.5 * img["natural"]:
                problems.append(f"{rel}: {img['src']} did not enlarge on click ({big:.0f} px)")
            else:
                enlarged += 1
            page.keyboard.press("Escape")
        shot = SCREENSHOTS / (rel.replace("/", "_").removesuffix(".html") + ".png")
        page.screenshot(path=str(shot), full_page=True)
    page.close()
    assert not problems, "\n".join(problems)


FIGURES_JS = """Array.from(document.querySelectorAll('main img')).map((img, i) => {
  const next = img.nextElementSibling;
  return {i: i, src: img.currentSrc || img.src, shown: img.getBoundingClientRect().width, natural: img.naturalWidth,
          column: img.parentElement.getBoundingClientRect().width,
          note: next && next.classList.contains('enlarge-note') && next.checkVisibility() ? next.textContent : ''};
})"""


def test_figure_text_is_at_least_9_px_as_shown_and_reduced_figures_say_they_enlarge(book, server, browser):
    """Legible: every figure's smallest text (recorded in its PNG by companion.chapters.common.render_png, in px of the
    image) times the scale the page shows the image at (shown / natural width) is >= MIN_TEXT_PX in a 1400 px and
    a 1000 px window; an image without that record was not drawn in the book's style and fails. The column is at
    least BOOK_CONTENT_PX wide there (the width tests/book/test_figures.py holds each figure function to). In every
    window, a 600 px one too (where figures must shrink), a figure shown below its natural size says so and that a
    click enlarges it (enlarge.js)."""
    from companion.chapters.common import BOOK_CONTENT_PX, MIN_TEXT_PX, png_text_record

    problems, measured, reduced = [], [], 0
    for width in (1400, 1000, 600):
        page = browser.new_page(viewport={"width": width, "height": 1000})
        for rel in _chapter_pages():
            page.goto(urljoin(server, rel), wait_until="networkidle")
            page.wait_for_timeout(100)
            for img in page.evaluate(FIGURES_JS):
                name = f"{rel} at {width} px: image {img['i']} ({img['src'].rsplit('/', 1)[-1][:16]})"
                if img["shown"] < img["natural"] - 1:
                    reduced += width == 600
                    if "click the figure to enlarge it" not in img["note"]:
                        problems.append(f"{name}: shown at {img['shown']:.0f} of {img['natural']} px, no enlarge note")
                if width == 600:
                    continue
                path = book / unquote(urlparse(img["src"]).path).lstrip("/")
                px, natural = png_text_record(path.read_bytes()) if path.suffix == ".png" else (None, 0)
                if px is None:
                    problems.append(f"{name}: no smallest-text record (not drawn with use_book_style)")
                    continue
                shown = px * img["shown"] / img["natural"]
                measured.append(shown)
                if shown < MIN_TEXT_PX:
                    problems.append(f"{name}: smallest text {px:.1f} px in a {natural} px image shown "
                                    f"{img['shown']:.0f} px wide: {shown:.1f} px < {MIN_TEXT_PX}")
                if img["column"] < BOOK_CONTENT_PX - 1:
                    problems.append(f"{name}: its column is {img['column']:.0f} px, narrower than BOOK_CONTENT_PX")
        page.close()
    assert measured and reduced, f"no figure measured ({len(measured)}) or none reduced at 600 px ({reduced})"
    assert not problems, "\n".join(problems)


TABLES_JS = """() => Array.from(document.querySelectorAll('main table')).filter(t => t.checkVisibility())
.map((t, i) => {
  const cells = Array.from(t.querySelectorAll('th, td')).map(c => c.textContent.trim());
  return {i: i, first: cells.slice(0, 4).join(' | '), rows: t.rows.length,
          hiddenRows: t.scrollHeight > t.clientHeight + 2, hiddenColumns: t.scrollWidth > t.clientWidth + 2,
          elided: cells.filter(c => c === '...' || c === '…' || c.endsWith('…')).slice(0, 3)};
})"""


def test_no_table_is_cut(book, server, browser):
    """Every row and every column of every table is on the page: no inner scroll frame hiding rows or columns, no
    cell elided by pandas ("..." / "…"), at the width a reader's window has (1400 px)."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems, seen = [], 0
    for rel in _chapter_pages():
        page.goto(urljoin(server, rel), wait_until="networkidle")
        for t in page.evaluate(TABLES_JS):
            seen += 1
            what = f"{rel}: table {t['i']} ({t['rows']} rows, starting {t['first'][:60]!r})"
            if t["hiddenRows"]:
                problems.append(f"{what} hides rows behind a scroll frame")
            if t["hiddenColumns"]:
                problems.append(f"{what} hides columns behind a horizontal scroll")
            if t["elided"]:
                problems.append(f"{what} has elided cells {t['elided']}")
    page.close()
    assert seen, "no table found on any page"
    assert not problems, "\n".join(problems)


LAYOUT_JS = r"""() => {
  const main = document.querySelector('main').getBoundingClientRect();
  const out = {parameters: [], math: [], broken: []};
  document.querySelectorAll('.tag_parameters .cell_input').forEach(c => {
    const pre = c.querySelector('pre');
    const ws = pre ? window.getComputedStyle(pre).whiteSpace : 'none';
    if (c.checkVisibility() && !ws.startsWith('pre-wrap')) out.parameters.push(ws);
  });
  document.querySelectorAll('main mjx-container[display="true"]').forEach(m => {
    // a scroll frame shows no bar until touched: the reader sees the equation cut, so it must fit
    if (m.getBoundingClientRect().right > main.right + 2 || m.scrollWidth > m.clientWidth + 2) {
      out.math.push(m.textContent.slice(0, 40));
    }
  });
  // a number (its sign only where no word precedes it: a line may break after the hyphen of "mlp-128") or a word
  const token = /(?<![\w.)\]])[-+]?\d[\d.,]*(?:e[-+]?\d+)?%?|[A-Za-z]{2,}/gi;
  document.querySelectorAll('main table td, main table th').forEach(cell => {
    if (!cell.checkVisibility()) return;
    const walk = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let node = walk.nextNode(); node; node = walk.nextNode()) {
      for (const m of node.textContent.matchAll(token)) {
        const range = document.createRange();
        range.setStart(node, m.index);
        range.setEnd(node, m.index + m[0].length);
        const rects = Array.from(range.getClientRects()).filter(r => r.width > 0);
        const tops = new Set(rects.map(r => Math.round(r.top)));
        if (tops.size > 1) out.broken.push(m[0]);
      }
    }
  });
  return out;
}"""


def test_parameters_fold_math_fits_or_scrolls_and_no_word_breaks_in_a_table(book, server, browser):
    """Small layout defects once seen: the parameters cell is folded (or wraps when shown); every display equation
    fits the column at 1400 and 1000 px (a wide one is set smaller, fit-tables.js); at 1400 px no number or word in
    a table cell is split across lines (a column sized by its longest word, never letter by letter)."""
    problems = []
    for width in (1400, 1000):  # a full-width window, and one beside the paper's PDF
        page = browser.new_page(viewport={"width": width, "height": 1000})
        for rel in _chapter_pages():
            page.goto(urljoin(server, rel), wait_until="load")
            if page.evaluate("document.querySelectorAll('.math').length") > 0:
                page.wait_for_selector("mjx-container", state="attached", timeout=15000)
                page.evaluate("() => MathJax.startup.promise")
                page.wait_for_timeout(300)  # fit-tables.js sets a wide equation smaller once typeset
            found = page.evaluate(LAYOUT_JS)
            if found["parameters"]:
                problems.append(f"{rel} at {width} px: the parameters cell is unfolded and unwrapped "
                                f"({found['parameters']})")
            if found["math"]:
                problems.append(f"{rel} at {width} px: display math wider than the page: {found['math'][:3]}")
            if width == 1400 and found["broken"]:
                problems.append(f"{rel}: words or numbers split inside a table cell: {found['broken'][:5]}")
        page.close()
    assert not problems, "\n".join(problems)

// Wide tables and wide display equations fit the page: one wider than its column is set in a smaller font, step by
// step (tables down to 60 % of their size, equations to 70 %), so that every column is on the page rather than behind
// a horizontal scroll (tests/book/test_book_browser.py, test_no_table_is_cut). Offline, no dependencies.
(function () {
  function shrink(element, floor, step) {
    var size = parseFloat(window.getComputedStyle(element).fontSize);
    var smallest = floor * size;
    while (element.scrollWidth > element.clientWidth + 1 && size > smallest) {
      size = Math.max(smallest, size * step);
      element.style.fontSize = size + "px";
    }
  }
  function fit(table) {
    shrink(table, 0.6, 0.92);
  }
  function fitAll() {
    document.querySelectorAll("main table").forEach(fit);
  }
  // A display equation wider than the column (Theorem 5.3's three clauses on one line) is set smaller, down to 70 %,
  // once MathJax has typeset it; one still too wide scrolls in its own line (book.css), never cut at the page edge.
  function fitMath() {
    document.querySelectorAll('main mjx-container[display="true"]').forEach(function (m) {
      shrink(m, 0.7, 0.95);
    });
  }
  function whenTypeset() {
    if (window.MathJax && window.MathJax.startup && window.MathJax.startup.promise) {
      window.MathJax.startup.promise.then(fitMath);
    }
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", fitAll);
  } else {
    fitAll();
  }
  if (document.readyState === "complete") {
    whenTypeset();
  } else {
    window.addEventListener("load", whenTypeset);
  }
})();

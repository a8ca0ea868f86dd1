// Wide tables (and wide display equations) fit the page: a table wider than its column is set in a smaller font, step by step down to 60 % of
// its size, so that every column is on the page rather than behind a horizontal scroll (tests/test_book_browser.py,
// test_no_table_is_cut). Offline, no dependencies.
(function () {
  function fit(table) {
    var size = parseFloat(window.getComputedStyle(table).fontSize);
    var smallest = 0.6 * size;
    while (table.scrollWidth > table.clientWidth + 1 && size > smallest) {
      size = Math.max(smallest, size * 0.92);
      table.style.fontSize = size + "px";
    }
  }
  function fitAll() {
    document.querySelectorAll("main table").forEach(fit);
  }
  // A display equation wider than the column (Theorem 5.3's three clauses on one line) is set smaller, down to 70 %,
  // once MathJax has typeset it; one still too wide scrolls in its own line (book.css), never cut at the page edge.
  function fitMath() {
    document.querySelectorAll('main mjx-container[display="true"]').forEach(function (m) {
      var size = parseFloat(window.getComputedStyle(m).fontSize);
      var smallest = 0.7 * size;
      while (m.scrollWidth > m.clientWidth + 1 && size > smallest) {
        size = Math.max(smallest, size * 0.95);
        m.style.fontSize = size + "px";
      }
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

// Wide tables fit the page: a table wider than its column is set in a smaller font, step by step down to 60 % of
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
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", fitAll);
  } else {
    fitAll();
  }
})();

// Click any figure of the book to see it at its natural size; click again or press Escape to close. Offline: no CDN.
// Caption convention: under every figure the page shows smaller than its natural size, a line says so and that a
// click enlarges it (tests/book/test_book_browser.py checks both). The line follows the window's width.
(function () {
  function note(img) {
    var next = img.nextElementSibling;
    var line = next && next.classList.contains("enlarge-note") ? next : null;
    var shown = img.getBoundingClientRect().width, natural = img.naturalWidth;
    if (!natural || shown >= natural - 1) { if (line) line.remove(); return; }
    if (!line) {
      line = document.createElement("span");
      line.className = "enlarge-note";
      img.insertAdjacentElement("afterend", line);
    }
    line.textContent = "Shown at " + Math.round(100 * shown / natural) + " % of its size: click the figure to enlarge it.";
  }
  function setup() {
    var overlay = document.createElement("div");
    overlay.id = "enlarge-overlay";
    overlay.setAttribute("role", "dialog");
    document.body.appendChild(overlay);
    function close() { overlay.classList.remove("open"); overlay.innerHTML = ""; }
    function open(img) {
      var big = document.createElement("img");  // created on demand: no empty <img> in the page
      big.src = img.currentSrc || img.src;
      big.alt = img.alt || "enlarged figure";
      var hint = document.createElement("span");
      hint.className = "enlarge-hint";
      hint.textContent = "click or Esc to close";
      overlay.innerHTML = "";
      overlay.appendChild(hint);
      overlay.appendChild(big);
      overlay.classList.add("open");
    }
    overlay.addEventListener("click", close);
    document.addEventListener("keydown", function (e) { if (e.key === "Escape") close(); });
    var figures = [];
    document.querySelectorAll("main img, article img, .bd-article img").forEach(function (img) {
      if (img.closest("a") || img.classList.contains("logo__image") || figures.indexOf(img) >= 0) return;
      figures.push(img);
      img.classList.add("enlargeable");
      img.setAttribute("title", "click to enlarge");
      img.addEventListener("click", function () { open(img); });
      if (img.complete) note(img); else img.addEventListener("load", function () { note(img); });
    });
    window.addEventListener("resize", function () { figures.forEach(note); });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setup); else setup();
})();

// Click any figure of the book to see it at its natural size; click again or press Escape to close. Offline: no CDN.
(function () {
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
    document.querySelectorAll("main img, article img, .bd-article img").forEach(function (img) {
      if (img.closest("a") || img.classList.contains("logo__image")) return;
      img.classList.add("enlargeable");
      img.setAttribute("title", "click to enlarge");
      img.addEventListener("click", function () { open(img); });
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setup); else setup();
})();

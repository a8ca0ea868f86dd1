// Click any figure of the book to see it at its natural size; click again or press Escape to close. Offline: no CDN.
(function () {
  function setup() {
    var overlay = document.createElement("div");
    overlay.id = "enlarge-overlay";
    overlay.setAttribute("role", "dialog");
    overlay.innerHTML = '<span class="enlarge-hint">click or Esc to close</span>';
    var big = document.createElement("img");
    big.alt = "";
    overlay.appendChild(big);
    document.body.appendChild(overlay);
    function close() { overlay.classList.remove("open"); big.removeAttribute("src"); }
    overlay.addEventListener("click", close);
    document.addEventListener("keydown", function (e) { if (e.key === "Escape") close(); });
    var images = document.querySelectorAll("main img, article img, .bd-article img");
    images.forEach(function (img) {
      if (img.closest("a") || img.classList.contains("logo__image")) return;
      img.classList.add("enlargeable");
      img.setAttribute("title", "click to enlarge");
      img.addEventListener("click", function () {
        big.src = img.currentSrc || img.src;
        big.alt = img.alt || "enlarged figure";
        overlay.classList.add("open");
      });
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setup); else setup();
})();

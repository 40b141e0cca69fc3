// The console's live parts: every element with data-refresh is replaced by that URL's fragment every
// data-every seconds (server-rendered and escaped HTML); an img with data-refresh-img is reloaded.
// Nothing is fetched while the tab is hidden.
(function () {
  "use strict";
  function every(el) { return Math.max(1, Number(el.dataset.every || 2)) * 1000; }
  function refresh(el) {
    if (document.hidden) { return; }
    fetch(el.dataset.refresh, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) { if (html !== null) { el.innerHTML = html; } })
      .catch(function () { /* the next tick tries again */ });
  }
  // A chart that is not there yet (a job before its first round) stays hidden until one loads.
  function reload(img) {
    if (document.hidden) { return; }
    var base = img.getAttribute("src").split("?")[0];
    var next = new Image();
    next.onload = function () { img.src = next.src; img.hidden = false; };
    next.src = base + "?t=" + Date.now();
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-refresh]").forEach(function (el) {
      setInterval(function () { refresh(el); }, every(el));
    });
    document.querySelectorAll("img[data-refresh-img]").forEach(function (img) {
      if (img.complete && img.naturalWidth === 0) { img.hidden = true; }
      img.addEventListener("error", function () { img.hidden = true; });
      var tick = 0;  // a hidden chart is asked for every 2 s, a shown one every data-every seconds
      setInterval(function () {
        tick += 2000;
        if (img.hidden || tick >= every(img)) { tick = 0; reload(img); }
      }, 2000);
    });
  });
})();

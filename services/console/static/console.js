// The console's live parts: every element with data-refresh is replaced by that URL's fragment
// (server-rendered, escaped HTML) data-every seconds after the previous answer came; an img with
// data-refresh-img is reloaded the same way. One request per part at a time; a failed one waits
// longer before the next (up to a minute), and nothing is asked while the tab is hidden.
(function () {
  "use strict";
  var MAX_WAIT_MS = 60000;
  function every(el) { return Math.max(1, Number(el.dataset.every || 2)) * 1000; }

  // Ask, then wait `every` (doubled after each failure) before asking again.
  function poll(el, ask) {
    var wait = every(el);
    function next() {
      if (document.hidden) { setTimeout(next, every(el)); return; }
      ask().then(function (ok) {
        wait = ok ? every(el) : Math.min(wait * 2, MAX_WAIT_MS);
      }, function () {
        wait = Math.min(wait * 2, MAX_WAIT_MS);
      }).then(function () { setTimeout(next, wait); });
    }
    setTimeout(next, wait);
  }

  function fragment(el) {
    return fetch(el.dataset.refresh, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html === null) { return false; }
        el.innerHTML = html;
        return true;
      });
  }

  // A chart that is not there yet (a job before its first round) stays hidden until one loads.
  function chart(img) {
    return new Promise(function (resolve) {
      var base = img.getAttribute("src").split("?")[0];
      var next = new Image();
      next.onload = function () { img.src = next.src; img.hidden = false; resolve(true); };
      next.onerror = function () { resolve(false); };
      next.src = base + "?t=" + Date.now();
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-refresh]").forEach(function (el) {
      poll(el, function () { return fragment(el); });
    });
    document.querySelectorAll("img[data-refresh-img]").forEach(function (img) {
      if (img.complete && img.naturalWidth === 0) { img.hidden = true; }
      img.addEventListener("error", function () { img.hidden = true; });
      poll(img, function () { return chart(img); });
    });
  });
})();

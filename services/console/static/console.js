// The console's live parts: every element with data-refresh is replaced by that URL's fragment
// (server-rendered, escaped HTML) data-every seconds after the previous answer came; an img with
// data-refresh-img is reloaded the same way. One request per part at a time; a failed one waits
// longer before the next (up to a minute), and nothing is asked while the tab is hidden.
(function () {
  "use strict";
  var MAX_WAIT_MS = 60000;
  var ANSWER_MS = 30000;  // a request unanswered this long is given up, and counts as a failure
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
    var abort = new AbortController();
    var timer = setTimeout(function () { abort.abort(); }, ANSWER_MS);
    return fetch(el.dataset.refresh, {
      credentials: "same-origin", headers: { "Accept": "text/html" }, signal: abort.signal
    })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        clearTimeout(timer);
        if (html === null) { return false; }
        el.innerHTML = html;
        return true;
      }, function () { clearTimeout(timer); return false; });
  }

  // A chart that is not there yet (a job before its first round) stays hidden until one loads, and
  // is asked for at the usual pace meanwhile: not there yet is no failure. Once shown, a failed
  // reload backs off as a fragment's does.
  function chart(img) {
    return new Promise(function (resolve) {
      var base = img.getAttribute("src").split("?")[0];
      var next = new Image();
      var timer = setTimeout(function () { next.src = ""; resolve(img.hidden); }, ANSWER_MS);
      next.onload = function () {
        clearTimeout(timer);
        img.src = next.src;
        img.hidden = false;
        resolve(true);
      };
      next.onerror = function () { clearTimeout(timer); resolve(img.hidden); };
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

/* gptlab: a bridge between the ipywidgets HTML manager and MathJax 3 (hand-written, not vendored).
 *
 * The widget manager (_vendor/jupyter-widgets/embed.js) typesets widget labels with the MathJax 2
 * API, `MathJax.Hub.Queue(["Typeset", MathJax.Hub, element])`, whenever `window.MathJax` exists.
 * The book loads MathJax 3, which has no `Hub`, so every widget with a description threw
 * "Cannot read properties of undefined (reading 'Queue')" half-way through rendering. This file,
 * loaded just before embed.js on pages with widgets (nb_ipywidgets_js in _config.yml), gives
 * MathJax 3 a `Hub.Queue` that forwards to `MathJax.typesetPromise`.
 */
(function () {
  "use strict";

  function typeset(element) {
    var mj = window.MathJax;
    if (!mj || !mj.startup || !mj.startup.promise || !mj.typesetPromise) {
      return;
    }
    // Chain on startup.promise, as the MathJax 3 docs recommend for typesetting added content.
    mj.startup.promise = mj.startup.promise
      .then(function () {
        return mj.typesetPromise(element ? [element] : undefined);
      })
      .catch(function (err) {
        console.warn("gptlab: MathJax could not typeset a widget label", err);
      });
  }

  function install() {
    var mj = window.MathJax;
    // Only the real MathJax 3 object (it has a version); before it loads, window.MathJax is the
    // configuration object, whose keys MathJax moves under MathJax.config.
    if (mj && typeof mj.version === "string" && mj.version.charAt(0) === "3" && !mj.Hub) {
      mj.Hub = {
        Queue: function (job) {
          typeset(Array.isArray(job) ? job[2] : undefined);
        },
      };
    }
  }

  // MathJax is a deferred script: it has run by DOMContentLoaded. The widget manager renders on
  // "load" (or at once when the document is already complete); these listeners are registered
  // before embed.js registers its own, so they run first.
  install();
  document.addEventListener("DOMContentLoaded", install);
  window.addEventListener("load", install);
})();

/* Accessibility fixes to the markup the theme and its extensions write, applied as
   each page loads (Jupyter Book includes every _static/*.js). The site check runs
   axe-core on every page (tools/site_check.py); these are what it found.

   - Label in name (WCAG 2.5.3): the theme names its search button "Search" while
     it shows "Search Ctrl+K", its colour-mode button "Color mode" while it shows
     the mode's icon, and every hidden cell's summary "Toggle hidden content"
     while it reads "Show code cell content". Without the aria-label the name is
     what the control shows, and it follows the text as it changes.
   - Lists: docutils gives the bibliography role="list" and each entry the
     DPUB role "doc-biblioentry", which ARIA 1.2 deprecates; assistive
     technology (and axe) then sees the entries' links as the list's children.
     Each entry becomes a "listitem".
*/
(function () {
  'use strict';
  function fix() {
    document.querySelectorAll('.search-button-field[aria-label], .theme-switch-button[aria-label], ' +
                              'details > summary[aria-label="Toggle hidden content"]').forEach(function (el) {
      el.removeAttribute('aria-label');
    });
    document.querySelectorAll('[role="list"] > [role="doc-biblioentry"]').forEach(function (el) {
      el.setAttribute('role', 'listitem');
    });
  }
  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', fix);
  else fix();
})();

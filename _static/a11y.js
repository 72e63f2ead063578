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
   - Landmarks: the primary sidebar holds the book's title link and the search
     button above its "Main" navigation, outside any landmark, so a screen
     reader's landmark list skips them. The sidebar becomes a navigation
     landmark of its own, named "Book".
   - Keyboard: a pool picture scrolls sideways inside its box where the column
     is narrower than the picture (a phone, see custom.css). Such a box, and
     only then, joins the Tab order (a scrolling box must be reachable to be
     scrolled with the keys), named by its picture.
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
    var sidebar = document.getElementById('pst-primary-sidebar');
    if (sidebar && !sidebar.hasAttribute('role')) {
      sidebar.setAttribute('role', 'navigation');
      sidebar.setAttribute('aria-label', 'Book');
    }
  }
  function scrollers() {
    document.querySelectorAll('.pagedkv-pool').forEach(function (el) {
      if (el.scrollWidth > el.clientWidth + 1) {
        var svg = el.querySelector('svg');
        el.setAttribute('tabindex', '0');
        el.setAttribute('role', 'region');
        el.setAttribute('aria-label', (svg && svg.getAttribute('aria-label')) || 'block pool');
      } else if (el.getAttribute('tabindex') === '0') {
        el.removeAttribute('tabindex');
        el.removeAttribute('role');
        el.removeAttribute('aria-label');
      }
    });
  }
  function all() { fix(); scrollers(); }
  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', all);
  else all();
  window.addEventListener('load', scrollers);
  window.addEventListener('resize', scrollers);
})();

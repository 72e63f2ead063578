/* The explorables' shared part: Python's number formatting, and mounting.

   explorables.py inlines this file, then one explorable's file (explore_*.js),
   then a call `pkvExplore.mount('<dom id>')`, into the page. Node runs the
   same two files in the agreement test (tools/tests/test_explorables.py), so
   everything a figure depends on lives in plain functions without the DOM.

   A figure must read exactly as the library prints it, so the arithmetic is
   done as Python does it on doubles, and the formatting too:

   floorDiv(a, b)    Python's a // b on floats (CPython's float_floor_div)
   fixed(x, d, ',')  f"{x:,.{d}f}": rounded half to even on the exact binary
                     value (JavaScript's toFixed rounds ties up)
   repr(x)           repr(float): shortest round trip, "4.0" not "4"
   round2(x)         f"{round(x, 2)}" (vLLM's format_gib)
   int(n)            f"{n:,}" for an integer
   table(rows)       a two-column table of [label, value] rows, escaped

   mount(id)         wires an explorable's controls: on every input it
                     recomputes the figures (kind.compute) and redraws the
                     output (kind.render). The controls carry `hidden` in the
                     markup; mount unhides them (and hides the note naming
                     the default settings), so a page where no script runs
                     shows the figures drawn for those settings and no dead
                     control.
*/
var pkvExplore = (typeof pkvExplore === 'object' && pkvExplore) || (function () {
  'use strict';

  function floorDiv(a, b) {
    var mod = a % b, div = (a - mod) / b;
    if (mod && ((b < 0) !== (mod < 0))) div -= 1;
    if (!div) return (a / b < 0 || Object.is(a / b, -0)) ? -0 : 0;
    var f = Math.floor(div);
    return div - f > 0.5 ? f + 1 : f;
  }

  function cdiv(a, b) { return -floorDiv(-a, b); }

  // x = mant * 2**exp exactly, for a finite x >= 0.
  function exact(x) {
    var view = new DataView(new ArrayBuffer(8));
    view.setFloat64(0, x);
    var hi = view.getUint32(0), lo = view.getUint32(4), e = (hi >>> 20) & 0x7ff;
    var mant = (BigInt(hi & 0xfffff) << 32n) | BigInt(lo);
    return e === 0 ? [mant, -1074] : [mant | (1n << 52n), e - 1075];
  }

  function group(digits) { return digits.replace(/\B(?=(\d{3})+(?!\d))/g, ','); }

  function fixed(x, d, comma) {
    var neg = x < 0 || Object.is(x, -0), p = exact(Math.abs(x));
    var num = p[0] * 10n ** BigInt(d), den = 1n;
    if (p[1] >= 0) num <<= BigInt(p[1]); else den <<= BigInt(-p[1]);
    var q = num / den, twice = 2n * (num % den);
    if (twice > den || (twice === den && (q & 1n))) q += 1n;
    var s = q.toString().padStart(d + 1, '0');
    var whole = s.slice(0, s.length - d), frac = s.slice(s.length - d);
    return (neg ? '-' : '') + (comma ? group(whole) : whole) + (d ? '.' + frac : '');
  }

  function repr(x) {
    var a = Math.abs(x);
    if (a !== 0 && (a >= 1e16 || a < 1e-4)) {
      var m = x.toExponential().match(/^(.*)e([+-])(\d+)$/);
      return m[1] + 'e' + m[2] + m[3].padStart(2, '0');
    }
    var s = Object.is(x, -0) ? '-0' : String(x);
    return s.indexOf('.') < 0 ? s + '.0' : s;
  }

  function round2(x) {
    var s = fixed(x, 2).replace(/0+$/, '');
    return s.endsWith('.') ? s + '0' : s;
  }

  function int(n) { return (n < 0 ? '-' : '') + group(String(Math.abs(n))); }

  function esc(s) {
    return String(s).replace(/[&<>"']/g, function (c) {
      return {'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;'}[c];
    });
  }

  // A two-column table of [label, value] rows, both escaped.
  function table(rows) {
    return "<table class='pkv-table'>" + rows.map(function (kv) {
      return '<tr><td>' + esc(kv[0]) + '</td><td>' + esc(kv[1]) + '</td></tr>';
    }).join('') + '</table>';
  }

  var kinds = {};

  function mount(id) {
    var root = typeof document === 'object' && document.getElementById(id);
    if (!root || root.dataset.mounted) return;
    var kind = kinds[root.dataset.kind], config = JSON.parse(root.dataset.config);
    var controls = root.querySelectorAll('[data-input]');
    function values() {
      var v = {};
      controls.forEach(function (el) {
        // a number field left empty, or holding no number, reads '': NaN, never 0
        v[el.dataset.input] = el.dataset.type === 'str' ? el.value
          : el.value === '' ? NaN : Number(el.value);
        var shown = root.querySelector('output[for="' + el.id + '"]');
        if (shown) shown.textContent = el.value;
      });
      return v;
    }
    function update() {
      var figures = kind.compute(kind.inputs(values(), config), config);
      root.querySelector('.pkv-out').innerHTML = kind.render(figures, config);
      root.dispatchEvent(new CustomEvent('pkv-update', {detail: figures}));
    }
    controls.forEach(function (el) { el.addEventListener('input', update); });
    root.querySelector('.pkv-controls').hidden = false;
    root.querySelectorAll('.pkv-static').forEach(function (el) { el.hidden = true; });
    root.dataset.mounted = '1';
    update();
  }

  return {floorDiv: floorDiv, cdiv: cdiv, fixed: fixed, repr: repr, round2: round2,
          int: int, esc: esc, table: table, kinds: kinds, mount: mount};
})();

/* Chapters 3 and 6: prefix-cache hits for a shared prompt, in the page.

   compute(inputs, config) redoes what KVCacheManager.get_computed_blocks and
   allocate_slots decide for request B after request A has run: the agreement
   test holds it to explorables.prefix_figures, which runs the real manager.
   The rules, as vLLM 0.33.0 applies them:
   - a block hits only if every token in it (and before it) is shared, and
     only full blocks are cached, so a hit is a whole number of blocks;
   - a hit covers at most num_tokens - 1 tokens: B's last token is always
     computed, for the logits of its first output token;
   - with a match unit h finer than the block (prefix_match_unit), the hit
     may go on into the next block by whole units of h; that block is shared
     only partly, so B gets a private copy of it (copy-on-write).

   inputs   shared (tokens A and B both open with), own (B's tokens after it),
            a_own (A's, at least 1), block_size, match_unit
   figures  verdict ('ok', or 'invalid' with the library's message), states
            (one per block of B: hit, copy, new), rows (the table), why
*/
pkvExplore.kinds.prefix = (function (X) {
  'use strict';

  function compute(inp) {
    var S = inp.shared, B = inp.block_size, h = inp.match_unit, L = S + inp.own;
    if (B % h) {
      return {verdict: 'invalid', message: 'hash_block_size=' + h + ' must divide block_size=' + B,
              states: [], rows: [], why: ''};
    }
    var most = Math.min(S, L - 1);  // tokens that may hit: shared ones, and never the last
    var full = Math.floor(most / B), partial = Math.floor((most % B) / h) * h;
    var hit = full * B + partial, blocks = X.cdiv(L, B), copies = partial > 0 ? 1 : 0;
    var states = [];
    for (var i = 0; i < blocks; i++) states.push(i < full ? 'hit' : i === full && copies ? 'copy' : 'new');
    var why = L - 1 < S
      ? 'At most L - 1 = ' + X.int(L - 1) + " tokens may hit: B's last token is computed, " +
        'for the logits of its first output token.'
      : 'B parts from A at token ' + X.int(S) + ': a block hits only if every token in it is shared.';
    if (hit < most) {
      why += ' ' + X.int(most - hit) + ' shared tokens are recomputed: they do not fill a whole ' +
        (h === B ? 'block' : 'match unit of ' + h) + '.';
    }
    return {verdict: 'ok', message: '', states: states, why: why, rows: [
      ["B's prompt", X.int(L) + ' tokens, ' + X.int(blocks) + ' blocks of ' + B],
      ['full blocks hit', X.int(full)],
      ['partial block hit', partial ? partial + ' of ' + B + ' slots, copied' : 'none'],
      ['tokens from the cache', X.int(hit) + ' of ' + X.int(L) + ' (' + X.fixed(100 * hit / L, 1) + ' %)'],
      ['tokens B computes', X.int(L - hit)],
      ['new blocks for B', X.int(blocks - full)],  // a partial hit's block is replaced by its copy
      ['copy-on-write copies', String(copies)]]};
  }

  function inputs(values, config) {
    var inp = Object.assign({}, config.fixed, values);
    if (inp.match_unit == null) inp.match_unit = inp.block_size;  // vLLM's default: the block
    return inp;
  }

  // class, letter (so a state reads without its colour), what it means
  var CELL = {hit: ['pkv-w', 'H', 'hit: shared with A'], copy: ['pkv-c', 'C', 'partial hit: a private copy'],
              new: ['pkv-u', '', 'computed by B']};

  function render(f) {
    if (f.verdict === 'invalid') {
      return "<div class='pkv-verdict pkv-invalid' data-verdict='invalid'><b>\u2718 not a valid " +
        "setting: </b><span class='pkv-message'>" + X.esc(f.message) + '</span></div>';
    }
    var counts = {hit: 0, copy: 0, new: 0}, cells = '';
    f.states.forEach(function (s) { counts[s]++; });
    if (f.states.length <= 64) {  // one cell per block of B
      f.states.forEach(function (s, i) {
        cells += "<span class='" + CELL[s][0] + "' title='block " + i + ': ' + CELL[s][2] + "'>" +
          CELL[s][1] + '</span>';
      });
    } else {
      Object.keys(CELL).forEach(function (k) {
        if (counts[k]) {
          cells += "<span class='" + CELL[k][0] + "' style='flex-grow:" + counts[k] + "'>" + CELL[k][1] + '</span>';
        }
      });
    }
    var legend = Object.keys(CELL).map(function (k) {
      return "<span><i class='" + CELL[k][0] + "'>" + CELL[k][1] + '</i>' + X.esc(CELL[k][2]) + ': ' +
        counts[k] + '</span>';
    }).join(' ');
    return "<div class='pkv-caption'>B's blocks, in order:</div><div class='pkv-slots pkv-blocks'>" + cells +
      "</div><div class='pkv-legend'>" + legend + '</div>' + X.table(f.rows) +
      "<div class='pkv-why'>" + X.esc(f.why) + '</div>';
  }

  return {compute: compute, inputs: inputs, render: render};
})(pkvExplore);

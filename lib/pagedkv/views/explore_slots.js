/* Chapter 5: the slot mapping of one request, step by step, in the page.

   compute(inputs, config) redoes what KVCacheManager.allocate_slots, the
   worker's BlockTable and the slot mapping do for one request: the agreement
   test holds it to explorables.slots_figures, which runs the library's.
   - The prompt runs in chunks of `chunk` tokens a step, then the request
     decodes one token a step.
   - A step needs cdiv(tokens so far, B) blocks; the missing ones are popped
     from the head of the free queue (config.queues[B], the library's queue
     for the pool's history) and appended to the request's row.
   - Token p goes to slot row[p // B] * B + p % B.

   inputs   prompt, block_size, chunk, step (from 1)
   figures  title, block_size, row (the block ids after the step), new (those
            appended this step), start and end (the step's positions), tokens
            ([p, p // B, block, p % B, slot] for each)
*/
pkvExplore.kinds.slots = (function (X) {
  'use strict';

  function compute(inp, config) {
    var P = inp.prompt, B = inp.block_size, queue = config.queues[String(B)];
    var row = [], done = 0, start = 0, n = 0, fresh = [];
    for (var k = 1; k <= inp.step; k++) {
      start = done;
      n = start < P ? Math.min(inp.chunk, P - start) : 1;
      fresh = [];
      while (row.length < X.cdiv(start + n, B)) {
        fresh.push(queue[row.length]);
        row.push(queue[row.length]);
      }
      done += n;
    }
    var tokens = [];
    for (var p = start; p < start + n; p++) {
      tokens.push([p, Math.floor(p / B), row[Math.floor(p / B)], p % B, row[Math.floor(p / B)] * B + p % B]);
    }
    var what = start < P ? 'prefill, tokens ' + X.int(start) + ' to ' + X.int(start + n - 1)
                         : 'decode, the token at position ' + X.int(start);
    return {title: 'step ' + inp.step + ': ' + what, block_size: B, row: row, 'new': fresh,
            start: start, end: start + n, tokens: tokens};
  }

  function inputs(values, config) { return Object.assign({}, config.fixed, values); }

  // One line per block of the row; its slots filled (written before), dotted (this step), hatched (not yet).
  function render(f) {
    var B = f.block_size, blocks = '';
    f.row.forEach(function (id, j) {
      var cells = '';
      for (var o = 0; o < B; o++) {
        var p = j * B + o, state = p < f.start ? 'pkv-w' : p < f.end ? 'pkv-now' : 'pkv-u';
        cells += "<span class='" + state + "'>" + (state === 'pkv-now' ? '\u2022' : '') + '</span>';
      }
      blocks += "<div class='pkv-blockrow'><span class='pkv-id'>" + j + ' \u2192 block ' + id +
        (f['new'].indexOf(id) >= 0 ? ' new' : '') + "</span><span class='pkv-slots'>" + cells + '</span></div>';
    });
    var head = '<tr><td>position</td><td>p // B</td><td>block</td><td>p % B</td><td>slot</td></tr>';
    var body = f.tokens.map(function (t) {
      return '<tr>' + t.map(function (v) { return '<td>' + v + '</td>'; }).join('') + '</tr>';
    }).join('');
    return "<div class='pkv-caption'>" + X.esc(f.title) + '; new blocks: ' +
      (f['new'].length ? f['new'].join(', ') : 'none') + "</div><div class='pkv-rowview'>" + blocks +
      "</div><div class='pkv-legend'><span><i class='pkv-w'></i>written before</span>" +
      "<span><i class='pkv-now'>\u2022</i>written this step</span>" +
      "<span><i class='pkv-u'></i>not yet written</span></div>" +
      "<div class='pkv-scroll'><table class='pkv-table pkv-grid'>" + head + body + '</table></div>';
  }

  return {compute: compute, inputs: inputs, render: render};
})(pkvExplore);

/* Chapter 2's tail waste against block size, in the page.

   compute(inputs, config) redoes budget.blocks_per_request,
   sim.unused_tail_slots, sim.uniform_tail_waste and budget.kv_bytes_per_token
   for one request: the agreement test holds it to explorables.tail_figures.

   inputs   length (tokens), block_size, model, dtype
   figures  written (tokens in the last block), tail (its unused slots),
            block_size, rows (the table)
*/
pkvExplore.kinds.tail = (function (X) {
  'use strict';
  var MiB = 1024 * 1024;

  function compute(inp, config) {
    var L = inp.length, B = inp.block_size, m = config.models[inp.model];
    var perToken = 2 * m.num_layers * m.num_kv_heads * m.head_dim * config.dtype_bytes[inp.dtype];
    var blocks = X.cdiv(L, B), tail = (B - L % B) % B, slots = blocks * B;
    return {written: B - tail, tail: tail, block_size: B, rows: [
      ['blocks of ' + B, X.int(blocks)],
      ['slots held', X.int(slots)],
      ['unused slots in the last block', X.int(tail)],
      ['share of the slots held', X.fixed(100 * tail / slots, 2) + ' %'],
      ['unused KV (' + inp.model + ', ' + inp.dtype + ')', X.fixed(tail * perToken / MiB, 2, ',') + ' MiB'],
      ['worst case, B - 1 slots', X.fixed((B - 1) * perToken / MiB, 2, ',') + ' MiB'],
      ['mean if lengths mod B are uniform', X.fixed((B - 1) / 2, 1) + ' slots']]};
  }

  function inputs(values, config) { return Object.assign({}, config.fixed, values); }

  // The last block: one cell per slot up to 64 (written filled, unused hatched), else a bar.
  function render(f) {
    var cells;
    if (f.block_size <= 64) {
      cells = '';
      for (var i = 0; i < f.block_size; i++) {
        cells += "<span class='" + (i < f.written ? 'pkv-w' : 'pkv-u') + "'></span>";
      }
    } else {
      cells = "<span class='pkv-w' style='flex-grow:" + f.written + "'></span>" +
              "<span class='pkv-u' style='flex-grow:" + f.tail + "'></span>";
    }
    return "<div class='pkv-caption'>the last block: " + f.written + ' written, ' + f.tail +
      ' unused</div>' + "<div class='pkv-slots'>" + cells + '</div>' +
      "<table class='pkv-table'>" + f.rows.map(function (kv) {
        return '<tr><td>' + X.esc(kv[0]) + '</td><td>' + X.esc(kv[1]) + '</td></tr>';
      }).join('') + '</table>';
  }

  return {compute: compute, inputs: inputs, render: render};
})(pkvExplore);

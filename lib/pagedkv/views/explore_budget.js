/* Chapter 1's memory-budget calculator, in the page.

   compute(inputs, config) is pagedkv.budget.plan, views.calculator.startup_error
   and budget.startup_log_lines redone in JavaScript, operation for operation,
   on doubles as Python computes them; the agreement test holds it to the
   library's figures (explorables.budget_figures) on hundreds of generated
   inputs. A custom model with sliding-window or chunked local attention
   layers (one local kind at a time) is planned by KV-cache groups as
   pagedkv.kv_cache_planning.plan_kv_cache plans it (groupPlan); Mamba state
   and MLA are not offered. config carries the library's tables (models,
   GPUs, dtype bytes), so no spec is typed twice. Errors are vLLM's messages
   as budget.py words them.

   inputs   gpu, gpu_mib (0: the GPU's own), model (or 'custom', shaped by
            custom_layers, custom_kv_heads, custom_head_dim, custom_params_b,
            custom_sliding_layers of them with a window of custom_window,
            or custom_chunked_layers of them in chunks of custom_chunk),
            dtype, tensor_parallel_size, gpu_memory_utilization, non_kv_gib,
            max_model_len, block_size, request_len, weight_gib (null: from
            the parameter count)
   figures  verdict ('ok', 'refused': the startup check's message, 'invalid':
            a typed figure out of bounds, or the pool is empty), message, rows
            (the plan's table), log (the two INFO lines), parts (weights,
            non-KV, KV pool, headroom in GiB), groups ([kind, layers, tokens
            per block, blocks per max_model_len request] per KV-cache group;
            empty for a model of full-attention layers only)
*/
pkvExplore.kinds.budget = (function (X) {
  'use strict';
  var KiB = 1024, GiB = 1024 * 1024 * 1024;

  function Refusal(message) { this.message = message; }

  function headsPerRank(m, tp) {
    if (tp <= m.num_kv_heads) {
      if (m.num_kv_heads % tp) {
        throw new Refusal(m.num_kv_heads + ' KV heads of ' + m.name +
                          ' do not split evenly across tensor_parallel_size=' + tp);
      }
      return m.num_kv_heads / tp;
    }
    if (tp % m.num_kv_heads) {
      throw new Refusal('tensor_parallel_size=' + tp + " is not a multiple of " + m.name + "'s " +
                        m.num_kv_heads + ' KV heads');
    }
    return 1;
  }

  // Why a typed figure cannot be used, or null: explorables.budget_refusal.
  function refusal(inp, config) {
    for (var i = 0; i < config.fields.length; i++) {
      var f = config.fields[i], v = inp[f[0]];
      if (f[0].indexOf('custom_') === 0 && inp.model !== 'custom') continue;
      if (typeof v !== 'number' || !isFinite(v) || v < f[2] || v > f[3] || (f[4] && !Number.isInteger(v))) {
        return f[1] + ' must be a ' + (f[4] ? 'whole ' : '') + 'number from ' + X.int(f[2]) + ' to ' +
          X.int(f[3]);
      }
    }
    if (inp.model !== 'custom') return null;
    var locals = [['custom_sliding_layers', 'custom sliding layers'],
                  ['custom_chunked_layers', 'custom chunked layers']];
    for (var j = 0; j < locals.length; j++) {
      if (inp[locals[j][0]] > inp.custom_layers) {
        return locals[j][1] + ' (' + X.int(inp[locals[j][0]]) + ') must be at most ' +
          'custom layers (' + X.int(inp.custom_layers) + ')';
      }
    }
    if (inp.custom_sliding_layers && inp.custom_chunked_layers) {
      return 'custom sliding layers (' + X.int(inp.custom_sliding_layers) + ') and custom chunked ' +
        'layers (' + X.int(inp.custom_chunked_layers) + ') cannot both be set: the custom model ' +
        'has one kind of local attention beside its full-attention layers';
    }
    return null;
  }

  // The model the setting names: a preset, or the custom one (explorables.budget_specs).
  function model(inp, config) {
    if (inp.model !== 'custom') return config.models[inp.model];
    return {name: 'the custom model', num_layers: inp.custom_layers, num_kv_heads: inp.custom_kv_heads,
            head_dim: inp.custom_head_dim, num_params: Math.trunc(inp.custom_params_b * 1e9),
            native_context: config.custom_context, sliding: inp.custom_sliding_layers,
            window: inp.custom_window, chunked: inp.custom_chunked_layers, chunk: inp.custom_chunk};
  }

  // The KV-cache groups of a model with `sliding` of its layers windowed or
  // `chunked` of them in chunks, never both (refusal)
  // (kv_cache_planning.plan_kv_cache over kv_cache_spec.get_kv_cache_groups).
  // Both kinds have the same heads, so their pages are equal and unification
  // changes nothing. Layer 0 is local, so the local kind is grouped first.
  // Each kind splits into cdiv(n, groupSize) groups of layers[i::k], so one
  // block id costs a page times the layers of the largest group.
  function groupPlan(m, page, bs, maxLen, inFlight) {
    var local;
    if (m.sliding) {
      if (m.window > maxLen) {
        throw new Refusal('layer model.layers.0.self_attn: sliding_window=' + m.window + ' is larger ' +
                          'than max_model_len=' + maxLen + ', so the window never slides');
      }
      local = {name: 'sliding window ' + X.int(m.window), n: m.sliding, window: m.window};
    } else {
      if (m.chunk > maxLen) {
        throw new Refusal('layer model.layers.0.self_attn: attention_chunk_size=' + m.chunk + ' is ' +
                          'larger than max_model_len=' + maxLen + ', so no chunk ever ends');
      }
      local = {name: 'chunked local ' + X.int(m.chunk), n: m.chunked, chunk: m.chunk};
    }
    var kinds = [local];
    if (m.num_layers > local.n) kinds.push({name: 'full attention', n: m.num_layers - local.n});
    var counts = kinds.map(function (k) { return k.n; });
    var lo = Math.min.apply(null, counts), hi = Math.max.apply(null, counts);
    var size = hi < lo * 1.5 ? hi : lo, groups = [], widest = 0;
    kinds.forEach(function (k) {
      var num = X.cdiv(k.n, size);
      for (var i = 0; i < num; i++) {
        var layers = X.cdiv(k.n - i, num);  // len(names[i::num])
        groups.push({kind: k.name, layers: layers, window: k.window, chunk: k.chunk});
        widest = Math.max(widest, layers);
      }
    });
    // Blocks one request of n tokens holds at most in a group: a window keeps
    // its last window - 1 tokens plus those in flight, and one more block (it
    // rarely starts on a boundary); a chunk keeps the chunk plus those in
    // flight, with no extra block; full attention keeps all n.
    function need(g, n) {
      if (g.window !== undefined) return X.cdiv(Math.min(g.window - 1 + inFlight, n), bs) + 1;
      if (g.chunk !== undefined) return X.cdiv(Math.min(g.chunk + inFlight, n), bs);
      return X.cdiv(n, bs);
    }
    return {groups: groups, page: page, perBlock: page * widest,
            blocks: function (n) { return groups.reduce(function (t, g) { return t + need(g, n); }, 0); },
            rows: function () { return groups.map(function (g) { return [g.kind, g.layers, bs, need(g, maxLen)]; }); }};
  }

  function plan(inp, config) {
    var m = model(inp, config), tp = inp.tensor_parallel_size;
    var mib = inp.gpu_mib ? inp.gpu_mib : config.gpus[inp.gpu];
    var total = mib * 1024 * 1024, bytes = config.dtype_bytes[inp.dtype];
    var util = inp.gpu_memory_utilization;
    var w = inp.weight_gib === null ? X.floorDiv(m.num_params * config.dtype_bytes.bf16, tp)
                                    : inp.weight_gib * GiB / tp;
    var nonKv = inp.non_kv_gib * GiB;
    var pool = total * util - w - nonKv;
    if (pool <= 0) {
      throw new Refusal('no memory left for the KV cache: ' + X.fixed(total / GiB, 2) + ' GiB x ' +
                        X.repr(util) + ' - ' + X.fixed(w / GiB, 2) + ' GiB weights - ' +
                        X.fixed(nonKv / GiB, 2) + ' GiB non-KV = ' + X.fixed(pool / GiB, 2) + ' GiB');
    }
    var heads = headsPerRank(m, tp);
    var page = inp.block_size * 2 * heads * m.head_dim * bytes;
    var groups = (m.sliding || m.chunked) ? groupPlan(m, page, inp.block_size, inp.max_model_len,
                                       inp.max_concurrent_batches * inp.max_num_batched_tokens) : null;
    var perBlock = groups ? groups.perBlock : page * m.num_layers;
    var blocks = X.floorDiv(pool, perBlock);
    var perToken = 2 * m.num_layers * heads * m.head_dim * bytes;
    var perRequest = groups ? groups.blocks(inp.request_len) : X.cdiv(inp.request_len, inp.block_size);
    return {model: m, tp: tp, total: total, util: util, weights: w, nonKv: nonKv, pool: pool,
            perBlock: perBlock, perToken: perToken, blocks: blocks, bs: inp.block_size,
            maxLen: inp.max_model_len, requestLen: inp.request_len, groups: groups,
            contiguous: X.floorDiv(pool, inp.max_model_len * perToken),
            // what fits: the null block never holds a token (budget.paged_ceiling)
            ceiling: X.floorDiv(Math.max(blocks - 1, 0), perRequest)};
  }

  var NO_MEMORY = 'No available memory for the cache blocks. Try increasing `gpu_memory_utilization` ' +
    'when initializing the engine (this flag also controls CPU memory reservation on the CPU backend, ' +
    'despite its name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.';

  function startupError(p) {
    var m = p.model;
    if (p.maxLen > m.native_context) {
      return 'User-specified max_model_len (' + p.maxLen + ') is greater than the derived ' +
        'max_model_len (max_position_embeddings=' + m.native_context + ' or model_max_length=None ' +
        "in model's config.json). To allow overriding this maximum, set the env var " +
        'VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.';
    }
    var usable = p.pool - p.perBlock;  // the null block never holds a token
    if (usable <= 0) return NO_MEMORY;
    var fits, needed = (p.groups ? p.groups.blocks(p.maxLen) : X.cdiv(p.maxLen, p.bs)) * p.perBlock;
    if (needed <= usable) return null;
    if (p.groups) {  // the longest length whose blocks fit: vLLM's binary search
      var lo = 1, hi = p.maxLen, mid;
      fits = 0;
      while (lo <= hi) {
        mid = Math.floor((lo + hi) / 2);
        if (p.groups.blocks(mid) * p.perBlock <= usable) { fits = mid; lo = mid + 1; } else { hi = mid - 1; }
      }
    } else {
      fits = Math.min(X.floorDiv(usable, p.perBlock) * p.bs, p.maxLen);
    }
    var estimate = fits > 0 ? 'Based on the available memory, the estimated maximum model length is ' +
                              fits + '. ' : '';
    return "To serve at least one request with the model's max seq len (" + p.maxLen + '), (' +
      X.round2(needed / GiB) + ' GiB KV cache is needed, which is larger than the available KV cache ' +
      'memory (' + X.round2(usable / GiB) + ' GiB). ' + estimate +
      'Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU backend) ' +
      'or decreasing `max_model_len` when initializing the engine. ' +
      'See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.';
  }

  function rows(p) {
    var per = p.tp > 1 ? ' per GPU' : '';
    var out = [['GPU memory', X.fixed(p.total / GiB, 2) + ' GiB']];
    if (p.tp > 1) out.push(['tensor_parallel_size', String(p.tp)]);
    if (p.groups) {
      var kinds = p.groups.groups.map(function (g) { return g.kind; }).filter(function (k, i, all) {
        return all.indexOf(k) === i;
      }).sort();
      out.push(['KV-cache groups', p.groups.groups.length + ' (' + kinds.join(', ') + ')'],
               ['page per layer', X.fixed(p.groups.page / KiB, 0, ',') + ' KiB']);
    }
    return out.concat([
      ['KV bytes per token' + per, X.fixed(p.perToken / KiB, 0, ',') + ' KiB'],
      ['weights' + per, X.fixed(p.weights / GiB, 2) + ' GiB'],
      ['non-KV allowance', X.fixed(p.nonKv / GiB, 2) + ' GiB'],
      ['KV pool' + per, X.fixed(p.pool / GiB, 2) + ' GiB'],
      ['blocks of ' + p.bs, X.int(p.blocks)],
      ['token slots', X.int(p.blocks * p.bs)],
      ['contiguous reservations of ' + X.int(p.maxLen), X.int(p.contiguous)],
      ['paged ceiling at ' + X.int(p.requestLen) + ' tokens', X.int(p.ceiling)]]);
  }

  // "Maximum concurrency": all blocks, the null block included, over one
  // max_model_len request's blocks summed over groups.
  function logLines(p) {
    var concurrency = p.blocks / (p.groups ? p.groups.blocks(p.maxLen) : X.cdiv(p.maxLen, p.bs));
    return ['Available KV cache memory: ' + X.round2(p.pool / GiB) + ' GiB',
            'GPU KV cache size: ' + X.int(Math.trunc(concurrency * p.maxLen)) + ' tokens, ' +
            'Maximum concurrency for ' + X.int(p.maxLen) + ' tokens per request: ' +
            X.fixed(concurrency, 2) + 'x'];
  }

  function compute(inp, config) {
    var p, bad = refusal(inp, config);
    if (bad) return {verdict: 'invalid', message: bad, rows: [], log: [], parts: [], groups: []};
    try {
      p = plan(inp, config);
    } catch (e) {
      if (!(e instanceof Refusal)) throw e;
      return {verdict: 'invalid', message: e.message, rows: [], log: [], parts: [], groups: []};
    }
    var error = startupError(p);
    var fits = 'one request of max_model_len=' + X.int(p.maxLen) + ' fits.';
    var parts = [['weights', p.weights], ['non-KV allowance', p.nonKv], ['KV pool', p.pool],
                 ['headroom', p.total * (1 - p.util)]];
    return {verdict: error ? 'refused' : 'ok', message: error || fits, rows: rows(p), log: logLines(p),
            parts: parts.map(function (kv) { return [kv[0], X.fixed(kv[1] / GiB, 2)]; }),
            groups: p.groups ? p.groups.rows() : []};
  }

  // The controls' values, with what the page fixes: the request length, the
  // typed figures' defaults, and a logged weight figure for its own model.
  function inputs(values, config) {
    var v = Object.assign({}, config.fixed, values);
    v.weight_gib = config.weights.hasOwnProperty(v.model) ? config.weights[v.model] : null;
    return v;
  }

  var HEAD = {ok: '\u2714 startup check passes: ', refused: '\u2718 vLLM would refuse to start: ',
              invalid: '\u2718 this configuration does not fit: '};

  // The output, as explorables.render_budget draws it for the page without script.
  function render(f, config) {
    var out = "<div class='pkv-verdict pkv-" + f.verdict + "' data-verdict='" + f.verdict + "'><b>" +
      HEAD[f.verdict] + "</b><span class='pkv-message'>" + X.esc(f.message) + '</span></div>';
    if (f.parts.length) {
      out += "<div class='pkv-bar'>" + f.parts.map(function (kv) {
        return "<span style='flex-grow:" + kv[1] + ';background:' + config.colors[kv[0]] +
          "' title='" + X.esc(kv[0] + ': ' + kv[1] + ' GiB') + "'></span>";
      }).join('') + "</div><div class='pkv-legend'>" + f.parts.map(function (kv) {
        return "<span><i style='background:" + config.colors[kv[0]] + "'></i>" + X.esc(kv[0]) + ': ' +
          kv[1] + ' GiB</span>';
      }).join(' ') + '</div>';
    }
    if (f.rows.length) {
      out += "<table class='pkv-table'>" + f.rows.map(function (kv) {
        return '<tr><td>' + X.esc(kv[0]) + '</td><td>' + X.esc(kv[1]) + '</td></tr>';
      }).join('') + '</table>';
    }
    if (f.groups.length) {
      out += "<table class='pkv-table'><tr><th>group</th><th>layers</th><th>tokens per block</th>" +
        '<th>blocks per request</th></tr>' + f.groups.map(function (g, i) {
          return '<tr><td>' + i + ': ' + X.esc(g[0]) + '</td><td>' + X.int(g[1]) + '</td><td>' + X.int(g[2]) +
            '</td><td>' + X.int(g[3]) + '</td></tr>';
        }).join('') + '</table>';
    }
    if (f.log.length) {
      out += "<div class='pkv-log'>" + f.log.map(function (line) {
        return '<div>INFO ' + X.esc(line) + '</div>';
      }).join('') + '</div>';
    }
    return out;
  }

  return {compute: compute, inputs: inputs, render: render};
})(pkvExplore);

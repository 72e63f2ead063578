"""The model the 2,048-block experiment runs on a CPU, shared by the benchmark and the page.

``bench/engine.py`` runs the experiment on it; ``bench/_report.py`` explains,
on the benchmarks page, why its pool has half the bytes of chapter 8's. Kept
apart so that neither module imports the other for it.
"""

# The tiny preset cut to one layer and one KV head (chapter 8's one-layer model
# keeps two), so that 8,000 tokens of quadratic prefill attention take about a
# second. Its blocks are half as large; the block counts are the same.
CPU_EXPERIMENT_MODEL = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            max_position_embeddings=32768)

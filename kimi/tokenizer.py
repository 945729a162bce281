"""Tokenizers: byte-level for the synthetic fixtures, tiktoken for a real Kimi checkpoint.

``ByteTokenizer(config)`` maps each UTF-8 byte ``b`` to id ``b + offset``, with the smallest offset
that keeps all 256 byte ids inside the vocabulary and clear of the special ids (bos/eos/pad): 3 for
the small presets (specials 0, 1, 2), 0 for kimi-linear-48b (specials at the top of the vocabulary).

``load_tokenizer(checkpoint_dir)`` returns a tiktoken-based ``TiktokenTokenizer`` when the checkpoint
ships ``tiktoken.model`` (Kimi's released tokenizer) and a ``ByteTokenizer`` otherwise.
"""
from __future__ import annotations

import os
from pathlib import Path

from .config import KimiConfig
from .validate import InvalidInput, as_object, as_str, field, inside, label, read_json_file


class TokenizerError(ValueError):
    """No usable tokenizer for a checkpoint (one-line message)."""


class ByteTokenizer:
    """UTF-8 bytes -> ids ``byte + offset`` (see the module docstring)."""

    kind = "bytes"

    def __init__(self, config: KimiConfig):
        specials = {t for name in ("bos_token_id", "eos_token_id", "pad_token_id") for t in config.special_ids(name)}
        for offset in range(0, config.vocab_size - 255):
            if not any(offset <= s < offset + 256 for s in specials):
                break
        else:
            raise TokenizerError(f"vocab_size {config.vocab_size}: no room for 256 byte ids clear of the "
                                 f"special ids {sorted(specials)}")
        self.offset = offset
        self.vocab_size = config.vocab_size
        self.bos_token_id, self.eos_token_id = config.bos_token_id, config.eos_token_id

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        """Ids outside the byte range (specials, unused ids) are dropped; invalid UTF-8 -> U+FFFD."""
        data = bytes(int(i) - self.offset for i in ids if 0 <= int(i) - self.offset < 256)
        return data.decode("utf-8", errors="replace")

    def describe(self) -> str:
        return f"byte-level (ids = bytes + {self.offset})"


# Kimi's pre-tokenizer pattern (tokenization_kimi.py of the released checkpoints).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED_SPECIAL_TOKENS = 256


class TiktokenTokenizer:
    """Kimi's BPE (``tiktoken.model``) with the special tokens of ``tokenizer_config.json``."""

    kind = "tiktoken"

    def __init__(self, model_file: Path):
        try:
            import tiktoken  # why: optional: only a checkpoint with a tiktoken model
            from tiktoken.load import load_tiktoken_bpe  # why: optional: only a checkpoint with a tiktoken model
        except ImportError:
            raise TokenizerError(f"{model_file}: this checkpoint ships a tiktoken tokenizer but the "
                                 "'tiktoken' package is not installed (pip install tiktoken)") from None
        ranks = load_tiktoken_bpe(str(model_file))
        n = len(ranks)
        specials = {f"<|reserved_token_{i}|>": i for i in range(n, n + NUM_RESERVED_SPECIAL_TOKENS)}
        for i, content in _added_tokens(model_file.parent).items():
            specials = {k: v for k, v in specials.items() if v != i}
            specials[content] = i
        self._enc = tiktoken.Encoding(name=model_file.parent.name, pat_str=KIMI_PAT_STR,
                                      mergeable_ranks=ranks, special_tokens=specials)
        self.path = model_file

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])

    def describe(self) -> str:
        return f"tiktoken ({self.path})"


MAX_TOKENIZER_CONFIG_BYTES = 64 << 20


def _added_tokens(root: Path) -> dict[int, str]:
    """id -> content of ``tokenizer_config.json``'s ``added_tokens_decoder`` (none without the file)."""
    try:
        cfg = inside(root, "tokenizer_config.json")
        if not cfg.is_file():
            return {}
        d = as_object(read_json_file(cfg, max_bytes=MAX_TOKENIZER_CONFIG_BYTES), str(cfg))
        added = as_object(d.get("added_tokens_decoder", {}), f"{cfg}: added_tokens_decoder")
        out = {}
        for key, tok in added.items():
            where = f"{cfg}: added_tokens_decoder: {label(key)}"
            if not (key.isascii() and key.isdigit() and len(key) <= 9):
                raise InvalidInput(f"{where}: expected a token id (digits)")
            out[int(key)] = as_str(field(as_object(tok, where), "content", where), f"{where}: content")
        return out
    except InvalidInput as exc:
        raise TokenizerError(str(exc)) from None


def load_tokenizer(checkpoint_dir: str | os.PathLike, config: KimiConfig | None = None):
    """The tokenizer of a checkpoint directory: tiktoken when it ships ``tiktoken.model`` (a clear
    ``TokenizerError`` if the package is missing), otherwise byte-level for its config. Files are
    followed through links only inside the directory (``validate.inside``)."""
    root = Path(checkpoint_dir)
    try:
        model_file = inside(root, "tiktoken.model")
    except InvalidInput as exc:
        raise TokenizerError(str(exc)) from None
    if model_file.is_file():
        return TiktokenTokenizer(model_file)
    if config is None:
        config = KimiConfig.from_json(root / "config.json")
    return ByteTokenizer(config)

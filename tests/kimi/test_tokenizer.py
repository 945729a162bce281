"""Byte-level tokenizer for fixtures; tiktoken only when the checkpoint ships one."""
import importlib.util

import pytest

from kimi.config import KimiConfig
from kimi.fixtures import default_checkpoint_path
from kimi.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer


def test_byte_ids_round_trip_and_avoid_the_special_ids():
    cfg = KimiConfig.from_name("tiny")
    tok = ByteTokenizer(cfg)
    ids = tok.encode("héllo, wörld ✓")
    specials = {cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id}
    assert tok.offset == 3 and not specials & set(ids) and max(ids) < cfg.vocab_size
    assert tok.decode(ids) == "héllo, wörld ✓"
    assert tok.decode([cfg.bos_token_id, *ids, cfg.eos_token_id]) == "héllo, wörld ✓"


def test_the_48b_vocabulary_uses_plain_bytes():
    assert ByteTokenizer(KimiConfig.from_name("kimi-linear-48b")).offset == 0


def test_a_vocabulary_without_room_for_bytes_is_an_error():
    import dataclasses

    cfg = dataclasses.replace(KimiConfig.from_name("tiny"), vocab_size=200)
    with pytest.raises(TokenizerError, match="no room for 256 byte ids"):
        ByteTokenizer(cfg)


def test_checkpoints_without_a_tiktoken_model_get_the_byte_tokenizer():
    tok = load_tokenizer(default_checkpoint_path())
    assert isinstance(tok, ByteTokenizer) and tok.encode("a") == [ord("a") + 3]


@pytest.mark.skipif(importlib.util.find_spec("tiktoken") is not None, reason="tiktoken is installed")
def test_a_tiktoken_checkpoint_without_tiktoken_installed_is_a_clear_error(tmp_path):
    (tmp_path / "tiktoken.model").write_text("IQ== 0\n")
    with pytest.raises(TokenizerError, match="ships a tiktoken tokenizer but the 'tiktoken' package is not installed"):
        load_tokenizer(tmp_path)

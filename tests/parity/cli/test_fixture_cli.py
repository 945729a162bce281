"""`parity fixture`: writes a loadable synthetic checkpoint; bad input is one line and exit code 2."""
import numpy as np
import pytest

from kimi.checkpoint import open_source
from kimi.config import KimiConfig
from kimi.synthetic import SyntheticSource
from parity.cli import main


def test_fixture_writes_a_sharded_checkpoint_equal_to_its_source(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["fixture", "tiny", str(out), "--seed", "9", "--shards", "2"]) == 0
    assert "wrote tiny (seed 9)" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"]
    ckpt, src = open_source(out), SyntheticSource(KimiConfig.from_name("tiny"), 9)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.A_log", "lm_head.weight"):
        np.testing.assert_array_equal(ckpt.get_raw(name), src.get_raw(name))


@pytest.mark.parametrize("argv, message", [
    (["fixture", "huge", "{out}"], "unknown preset 'huge'"),
    (["fixture", "tiny", "{out}", "--seed", "-1"], "--seed: expected 0 <= S < 2**32"),
    (["fixture", "tiny", "{out}", "--shards", "0"], "--shards: expected a positive count"),
    (["fixture", "tiny", "{out}", "--shards", "1000"], "cannot split 151 tensors into 1000 shards"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, argv, message):
    assert main([a.format(out=tmp_path / "x") for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_an_existing_directory_is_replaced_only_with_force(tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["fixture", "tiny", str(out)]) == 2
    assert "not empty (use --force" in capsys.readouterr().err and (out / "keep.txt").exists()
    assert main(["fixture", "tiny", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

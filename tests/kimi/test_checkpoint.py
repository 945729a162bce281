"""The safetensors reader/writer: round trips, interoperability with the safetensors library, bf16
rounding, and one error per way a checkpoint can be broken."""
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from kimi.checkpoint import (CheckpointConfigError, CheckpointError, CheckpointWarning, open_source,
                                  plan_shards, read_header, save_checkpoint)
from kimi.config import ConfigError, KimiConfig
from kimi.fixtures import write_fixture
from kimi.storage import bf16_bits_to_float64, float_to_bf16_bits
from kimi.synthetic import SyntheticSource
from kimi.tensors import storage_dtype

TINY = KimiConfig.from_name("tiny")
DT_BIAS = "model.layers.0.self_attn.dt_bias"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_fixture("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=3)


def copy_of(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def rewrite_header(file: Path, edit) -> None:
    """Apply ``edit(header_dict)`` to a safetensors file, keeping its data bytes."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def stored_tensors(file: Path) -> dict:
    """name -> (dtype code, shape, bytes) of a safetensors file, in file order."""
    raw = file.read_bytes()
    h = read_header(file)
    return {n: (t.dtype, list(t.shape), raw[h.data_start + t.begin:h.data_start + t.end])
            for n, t in h.tensors.items()}


def write_tensors(file: Path, tensors: dict) -> None:
    """A valid safetensors file of name -> (dtype code, shape, bytes), tensors in the given order."""
    header, data = {}, b""
    for name, (code, shape, blob) in tensors.items():
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(len(text).to_bytes(8, "little") + text + data)


def edit_tensors(file: Path, edit) -> None:
    """Apply ``edit(tensors)`` to ``stored_tensors(file)`` and write the file back, valid."""
    tensors = stored_tensors(file)
    edit(tensors)
    write_tensors(file, tensors)


def patch_data(file: Path, name: str, data: bytes, at: int = 0) -> None:
    raw = bytearray(file.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin = json.loads(raw[8:8 + n])[name]["data_offsets"][0]
    raw[8 + n + begin + at: 8 + n + begin + at + len(data)] = data
    file.write_bytes(bytes(raw))


# -- bf16 rounding --------------------------------------------------------------------------------

def test_float32_to_bf16_matches_torch_round_to_nearest_even():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    bits[:8] = [0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x00008000, 0x80018000, 0]
    x = bits.view(np.float32)
    ours = float_to_bf16_bits(x)
    theirs = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = np.isfinite(x)
    np.testing.assert_array_equal(ours[finite], theirs[finite])
    assert np.isnan(bf16_bits_to_float64(ours[~finite & np.isnan(x)])).all()


def test_float64_to_bf16_rounds_once_at_midpoints():
    rng = np.random.default_rng(1)
    b = rng.integers(0x0080, 0x7F00, 5000).astype(np.uint16)  # positive normal bf16 values
    lo, hi = bf16_bits_to_float64(b), bf16_bits_to_float64(b + np.uint16(1))
    mid = (lo + hi) / 2  # exact in float64
    even = np.where(b % 2 == 0, b, b + 1)
    np.testing.assert_array_equal(float_to_bf16_bits(mid), even)
    # just above / below the midpoint: a float32 intermediate would round these to the midpoint (a tie)
    np.testing.assert_array_equal(float_to_bf16_bits(np.nextafter(mid, np.inf)), b + 1)
    np.testing.assert_array_equal(float_to_bf16_bits(np.nextafter(mid, -np.inf)), b)
    np.testing.assert_array_equal(float_to_bf16_bits(-np.nextafter(mid, np.inf)), (b + 1) | 0x8000)
    assert float_to_bf16_bits(np.array([1e300, -1e300]).astype(np.float64)).tolist() == [0x7F80, 0xFF80]


# -- round trips ----------------------------------------------------------------------------------

def test_a_written_fixture_reads_back_bit_for_bit(tiny_dir):
    src, ckpt = SyntheticSource(TINY, 3), open_source(tiny_dir)
    assert ckpt.config == TINY and ckpt.names() == src.names()
    for name in src.names():
        assert ckpt.storage_dtype(name) == storage_dtype(name)
        np.testing.assert_array_equal(ckpt.get_raw(name), src.get_raw(name), err_msg=name)
    rows = [5, 0, 511, 5]
    np.testing.assert_array_equal(ckpt.get_rows("lm_head.weight", rows), src.get("lm_head.weight")[rows])


def test_sharded_and_single_file_checkpoints_hold_the_same_bits(tiny_dir, tmp_path):
    sharded = write_fixture("tiny", tmp_path / "sharded", seed=3, shards=4)
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) == 151
    assert len(list(sharded.glob("model-0000?-of-00004.safetensors"))) == 4
    a, b = open_source(tiny_dir), open_source(sharded)
    for name in a.names():
        np.testing.assert_array_equal(a.get_raw(name), b.get_raw(name), err_msg=name)


def test_the_greedy_shard_plan_starts_a_shard_when_the_next_tensor_does_not_fit():
    assert plan_shards([4, 4, 4, 10, 1], 8) == [0, 0, 1, 2, 3]
    assert plan_shards([4, 4], None) == [0, 0]


def test_the_writer_leaves_nothing_behind_when_it_fails(tmp_path):
    class Exploding(dict):
        def __getitem__(self, name):
            if name == "b":
                raise RuntimeError("boom")
            return super().__getitem__(name)

    with pytest.raises(RuntimeError, match="boom"):
        save_checkpoint(tmp_path / "out", TINY, Exploding(a=np.ones(3), b=np.ones(3)), dtypes=storage_dtype)
    assert list(tmp_path.iterdir()) == []
    save_checkpoint(tmp_path / "out", TINY, {"a": np.ones(3)}, dtypes=storage_dtype)
    with pytest.raises(FileExistsError, match="not empty"):
        save_checkpoint(tmp_path / "out", TINY, {"a": np.zeros(3)}, dtypes=storage_dtype)
    save_checkpoint(tmp_path / "out", TINY, {"a": np.zeros(3)}, dtypes=storage_dtype, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# -- the safetensors library reads our files, and we read its files --------------------------------

def test_safetensors_reads_our_float16_and_float32_tensors(tmp_path):
    st_numpy = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(2)
    tensors = {"a": rng.standard_normal((3, 5)), "b": rng.standard_normal(7), "c": rng.standard_normal((2, 2, 3))}
    kinds = {"a": "float16", "b": "float32", "c": "float16"}
    save_checkpoint(tmp_path / "x", TINY, tensors, dtypes=kinds)
    loaded = st_numpy.load_file(tmp_path / "x" / "model.safetensors")
    for name, x in tensors.items():
        assert loaded[name].dtype == np.dtype(kinds[name])
        np.testing.assert_array_equal(loaded[name], x.astype(kinds[name]))


def test_safetensors_reads_our_bf16_tensors(tiny_dir):
    st_torch = pytest.importorskip("safetensors.torch")
    import torch

    loaded = st_torch.load_file(tiny_dir / "model.safetensors")
    ckpt = open_source(tiny_dir)
    assert set(loaded) == set(ckpt.names())
    for name, t in loaded.items():
        assert t.dtype == (torch.float32 if storage_dtype(name) == "float32" else torch.bfloat16)
        np.testing.assert_array_equal(t.double().numpy(), ckpt.get(name).reshape(t.shape), err_msg=name)


def test_we_read_checkpoints_written_by_safetensors(tmp_path):
    st_torch = pytest.importorskip("safetensors.torch")
    import torch

    src = SyntheticSource(TINY, 5)
    out = tmp_path / "hf"
    out.mkdir()
    TINY.to_json(out / "config.json")
    tensors = {n: torch.from_numpy(src.get(n)).to(getattr(torch, storage_dtype(n))) for n in src.names()}
    tensors[Q_PROJ] = tensors[Q_PROJ].half()  # a float16 tensor too
    st_torch.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    ckpt = open_source(out)
    assert ckpt.storage_dtype(Q_PROJ) == "float16"
    for name in src.names():
        np.testing.assert_array_equal(ckpt.get(name), tensors[name].double().numpy(), err_msg=name)


def test_we_read_float_tensors_written_by_safetensors_numpy(tmp_path):
    st_numpy = pytest.importorskip("safetensors.numpy")
    x = {"v": np.arange(6, dtype=np.float16).reshape(2, 3), "w": np.linspace(-1, 1, 5, dtype=np.float32)}
    out = tmp_path / "np"
    out.mkdir()
    TINY.to_json(out / "config.json")
    st_numpy.save_file(x, str(out / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match="missing tensor model.embed_tokens.weight"):
            open_source(out)  # a real checkpoint needs the model's tensors...
    header = read_header(out / "model.safetensors")  # ...but the file itself parses
    assert header.tensors["v"].dtype == "F16" and header.tensors["w"].shape == (5,)


def test_two_dimensional_conv_weights_are_accepted_and_reshaped(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    name = "model.layers.0.self_attn.v_conv1d.weight"
    rewrite_header(d / "model.safetensors", lambda h: h[name].update(shape=[64, 4]))
    ckpt = open_source(d)
    assert ckpt.shape(name) == (64, 1, 4)
    np.testing.assert_array_equal(ckpt.get(name), open_source(tiny_dir).get(name))


# -- broken checkpoints: one error each ------------------------------------------------------------

def test_a_missing_directory_or_config_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        open_source(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        open_source(tmp_path)


def test_a_broken_config_raises_a_config_error_naming_the_key(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["vocab_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointConfigError, match=r"config\.json: missing required key 'vocab_size'") as e:
        open_source(d)
    assert isinstance(e.value, ConfigError) and isinstance(e.value, CheckpointError)
    (d / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        open_source(d)


def test_a_directory_without_weights_is_named(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        open_source(d)


def test_a_missing_tensor_is_named_with_its_shape(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    edit_tensors(d / "model.safetensors", lambda t: t.pop(Q_PROJ))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: missing tensor {Q_PROJ} "
                                              r"\(expected shape \(64, 64\)\)"):
        open_source(d)


def test_a_wrong_shape_is_named_with_the_expected_shape(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    name = "model.layers.0.self_attn.A_log"
    rewrite_header(d / "model.safetensors", lambda h: h[name].update(shape=[2]))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: model\.layers\.0\.self_attn\.A_log: "
                                              r"expected shape \(1, 1, 2, 1\), got \(2,\)"):
        open_source(d)


def test_an_unsupported_dtype_is_named(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    rewrite_header(d / "model.safetensors", lambda h: h[DT_BIAS].update(dtype="I32"))
    with pytest.raises(CheckpointError, match=rf"{DT_BIAS}: unsupported dtype I32; expected one of BF16, F16, F32, F64"):
        open_source(d)


def test_a_truncated_file_is_detected(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"data_offsets .* past the end of the data .*truncated"):
        open_source(d)
    f.write_bytes(f.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="header length .* runs past the end of the file"):
        open_source(d)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="truncated file"):
        open_source(d)


def test_offsets_that_disagree_with_the_shape_are_detected(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    rewrite_header(d / "model.safetensors",
                   lambda h: h[Q_PROJ].update(data_offsets=[h[Q_PROJ]["data_offsets"][0], h[Q_PROJ]["data_offsets"][1] - 2]))
    with pytest.raises(CheckpointError, match=rf"{Q_PROJ}: data_offsets .* expected 8192"):
        open_source(d)


def test_a_header_that_is_not_json_is_named(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8] = ord("[")
    raw[9] = ord("}")
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: header: not valid JSON"):
        open_source(d)


def test_an_index_naming_a_missing_shard_is_named(tmp_path):
    d = write_fixture("tiny", tmp_path / "s", seed=1, shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"index\.json: shard 'model-00002-of-00002\.safetensors' "
                                              r"\(holding .*\) does not exist"):
        open_source(d)


def test_an_index_mapping_a_tensor_to_the_wrong_shard_is_named(tmp_path):
    d = write_fixture("tiny", tmp_path / "s", seed=1, shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    index["weight_map"]["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="is mapped to model-0000.-of-00002.safetensors, which does not contain it"):
        open_source(d)


def test_non_finite_values_are_reported_on_get_naming_the_tensor(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    patch_data(d / "model.safetensors", Q_PROJ, (0x7FC0).to_bytes(2, "little"), at=2 * 70)
    ckpt = open_source(d)  # headers are fine; values are checked when read
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: {Q_PROJ}: 1 non-finite values "
                                              r"\(first at index \(1, 6\): nan\)"):
        ckpt.get(Q_PROJ)
    with pytest.raises(CheckpointError, match="non-finite"):
        ckpt.get_rows(Q_PROJ, [1])
    ckpt.get_rows(Q_PROJ, [0, 2])  # other rows are fine


def test_unknown_extra_tensors_give_a_warning_listing_them(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    edit_tensors(d / "model.safetensors", lambda t: t.update(  # two extra tensors with their own bytes
        {"model.layers.0.rotary_emb.inv_freq": ("F32", [64], bytes(256)), "extra.scale": ("F32", [2, 32], bytes(256))}))
    with pytest.warns(CheckpointWarning, match=r"ignoring 2 unexpected tensor\(s\): model\.layers\.0\.rotary_emb"
                                               r"\.inv_freq, extra\.scale"):
        ckpt = open_source(d)
    assert "extra.scale" in ckpt.names()


# -- the layouts transformers writes: F64 tensors, its names of the dense MLP ------------------------

def test_float64_tensors_load_exactly(tiny_dir, tmp_path):
    src = open_source(tiny_dir)
    d = save_checkpoint(tmp_path / "f64", TINY, {n: src.get(n) for n in src.names()}, dtypes=lambda n: "float64")
    ckpt = open_source(d)
    for name in src.names():
        assert ckpt.storage_dtype(name) == "float64"
        np.testing.assert_array_equal(ckpt.get(name), src.get(name), err_msg=name)
    rows = [3, 0, 3]
    np.testing.assert_array_equal(ckpt.get_rows("lm_head.weight", rows), src.get("lm_head.weight")[rows])


def test_float64_overflowing_sums_are_finite_but_nans_are_named(tmp_path, tiny_dir):
    src = open_source(tiny_dir)
    big = {n: src.get(n) for n in src.names()}
    big[Q_PROJ] = np.full((64, 64), 1e308)  # finite values whose float64 sum overflows
    d = save_checkpoint(tmp_path / "f64", TINY, big, dtypes=lambda n: "float64")
    assert np.isfinite(open_source(d).get(Q_PROJ)).all()
    big[Q_PROJ][5, 9] = np.nan
    d = save_checkpoint(tmp_path / "f64", TINY, big, dtypes=lambda n: "float64", overwrite=True)
    with pytest.raises(CheckpointError, match=rf"{Q_PROJ}: 1 non-finite values \(first at index \(5, 9\)"):
        open_source(d).get(Q_PROJ)


def _rename_dense_mlp(file: Path, layer: int = 0, keep_hub: bool = False) -> None:
    def edit(t):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            hub = f"model.layers.{layer}.mlp.{proj}.weight"
            t[f"model.layers.{layer}.block_sparse_moe.{proj}.weight"] = t[hub] if keep_hub else t.pop(hub)
    edit_tensors(file, edit)


def test_transformers_names_of_the_dense_mlp_read_as_the_hub_names(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    _rename_dense_mlp(d / "model.safetensors")
    ckpt, hub = open_source(d), open_source(tiny_dir)
    assert sorted(ckpt.names()) == sorted(hub.names())
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.0.mlp.{proj}.weight"
        np.testing.assert_array_equal(ckpt.get(name), hub.get(name))


def test_both_layouts_of_the_dense_mlp_at_once_are_an_error(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    _rename_dense_mlp(d / "model.safetensors", keep_hub=True)
    with pytest.raises(CheckpointError, match=r"both model\.layers\.0\.mlp\.gate_proj\.weight \(hub layout\) and "
                                              r"model\.layers\.0\.block_sparse_moe\.gate_proj\.weight \(transformers "
                                              r"layout\) are present"):
        open_source(d)


def test_a_non_finite_value_under_a_transformers_name_is_reported_by_that_name(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    _rename_dense_mlp(d / "model.safetensors")
    alt = "model.layers.0.block_sparse_moe.up_proj.weight"
    patch_data(d / "model.safetensors", alt, (0x7FC0).to_bytes(2, "little"))
    with pytest.raises(CheckpointError, match=rf"{alt}: 1 non-finite values"):
        open_source(d).get("model.layers.0.mlp.up_proj.weight")


# -- nothing outside the checkpoint is read --------------------------------------------------------

def test_a_link_inside_the_folder_is_followed_and_one_outside_is_named(tiny_dir, tmp_path):
    d = copy_of(tiny_dir, tmp_path)
    (d / "model.safetensors").rename(d / "weights.bin")
    (d / "model.safetensors").symlink_to("weights.bin")
    open_source(d)
    outside = tmp_path / "elsewhere.safetensors"
    (d / "weights.bin").rename(outside)
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"copy/model\.safetensors: a link to a file outside the checkpoint "
                                              r"folder; only a hub-cache snapshot's links into its blobs/ are followed$"):
        open_source(d)


def test_an_index_naming_a_path_instead_of_a_file_name_is_refused(tmp_path):
    d = write_fixture("tiny", tmp_path / "s", seed=1, shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    for shard in ("../s/model-00001-of-00002.safetensors", "..", "/etc/passwd", 7, "model-00001-of-00002\x00",
                  "model-00001-of-00002.safetensors\n", ""):
        index["weight_map"][name] = shard
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match=r"index\.json: .*(must be a file name in the directory|"
                                                  r"expected a string, got the integer 7)"):
            open_source(d)

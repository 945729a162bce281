"""Hypothesis drives config.json, index and safetensors-header mutations of the bundled fixture
through ``parity diff`` (in-process): every run ends in exit 2 with one ``error:`` line and no
traceback. A checkpoint that opens fails on the out-of-vocabulary prompt instead, so no model ever
runs; a config that opens must have every value of the type JSON gave it. The classes: any JSON
value in any key the model reads (nested layer lists too, with transformers' ``layer_types``
beside them), any shard name an index may hold."""
import contextlib
import io
import json
import shutil

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kimi.config import LIMITS, ConfigError, KimiConfig
from kimi.fixtures import default_checkpoint_path, write_fixture
from parity.cli import main
from tests.malformed.corpus import BEYOND, OPENED

safetensors = pytest.importorskip("safetensors", reason="the safetensors library is the oracle of the header fuzzer")

FUZZ = settings(max_examples=5 * settings.default.max_examples,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return shutil.copytree(default_checkpoint_path(), tmp_path_factory.mktemp("fuzz") / "ckpt")


def run(argv) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    return rc, out.getvalue() + err.getvalue()


def assert_one_line(rc, text):
    assert rc == 2 and text.startswith("error: ") and text.count("\n") == 1, text
    assert "Traceback" not in text


# -- config.json ------------------------------------------------------------------------------------

BASE = KimiConfig.from_name("tiny").to_hub_dict()
INT_KEYS = [k for k in LIMITS if k in BASE]
BOOL_KEYS = ["tie_word_embeddings", "moe_renormalize", "use_grouped_topk"]
FLOAT_KEYS = ["rms_norm_eps", "routed_scaling_factor"]
LAYER_KEYS = ["linear_attn_config.kda_layers", "linear_attn_config.full_attn_layers"]
FIXED = {"hidden_act": "silu", "moe_router_activation_func": "sigmoid"}
KEYS = INT_KEYS + BOOL_KEYS + FLOAT_KEYS + LAYER_KEYS + list(FIXED) + [
    "eos_token_id", "bos_token_id", "linear_attn_config", "q_lora_rank", "layer_types", "mlp_layer_types"]
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
VALUES = st.one_of(
    st.integers(-3, 70), st.integers(-2 ** 70, 2 ** 70), st.sampled_from([0, 1, 2, 8, 512, 10 ** 9]),
    st.floats(allow_nan=False, allow_infinity=False, width=64), st.sampled_from([8.0, -1.0, 1e-5, 1e9, 0.0]),
    st.booleans(), st.none(), st.sampled_from(["false", "true", "8", "", "kda", "silu", "sigmoid", "gelu"]),
    st.lists(st.integers(-1, 6), max_size=5), st.just({}), st.just(LAYER_TYPES),
    # containers where scalars belong: the values a set or a dict lookup cannot take
    st.lists(st.one_of(st.lists(st.integers(1, 4), max_size=2), st.just({}), st.none(), st.just("1")), max_size=3),
)


def strictly_typed(key, value) -> bool:
    """Whether ``value`` has the JSON type ``key`` takes (not whether it is in range)."""
    if key in ("num_expert_group", "topk_group") and value is None:  # HF's "no grouping"
        return True
    if key in FIXED:
        return value == FIXED[key]
    if key in LAYER_KEYS:
        return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    if key in INT_KEYS:
        return isinstance(value, int) and not isinstance(value, bool)
    if key in BOOL_KEYS:
        return isinstance(value, bool)
    if key in FLOAT_KEYS:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(KEYS), VALUES, min_size=1, max_size=3), drop=st.booleans(),
       transformers=st.booleans())
@example(changes={"linear_attn_config.kda_layers": [[1], [2]]}, drop=False, transformers=True)
def test_fuzzed_configs_end_in_one_line_and_exit_2(ckpt, changes, drop, transformers):
    cfg = json.loads(json.dumps(BASE))
    if transformers:  # transformers' per-layer lists beside the hub's (both read, compared)
        cfg.update(layer_types=LAYER_TYPES, mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    for key, value in changes.items():
        owner, _, leaf = key.rpartition(".")
        if not owner or isinstance(cfg.get(owner), dict):
            (cfg[owner] if owner else cfg)[leaf] = value
    if drop:
        first = next(iter(changes))
        if "." not in first:
            cfg.pop(first)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    rc, text = run(["diff", str(ckpt), "--prompt-ids", BEYOND])
    assert_one_line(rc, text)
    try:
        KimiConfig.from_hub_dict(cfg)
    except ConfigError:
        assert "config.json" in text, text
    else:  # accepted: every changed value had its JSON type (the tensors may still not fit it)
        assert all(strictly_typed(k, v) for k, v in changes.items() if present(cfg, k)), (changes, text)
        assert OPENED in text or "model.safetensors" in text, text


def present(cfg: dict, key: str) -> bool:
    owner, _, leaf = key.rpartition(".")
    return leaf in (cfg.get(owner, {}) if owner else cfg)


# -- index files ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    d = write_fixture("tiny", tmp_path_factory.mktemp("fuzz") / "sharded", seed=0, shards=2)
    return d, json.loads((d / "model.safetensors.index.json").read_text())


SHARD_NAMES = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=12),  # NUL, newlines, separators, dots
    st.sampled_from(["..", ".", "/etc/passwd", "../sharded/model-00001-of-00002.safetensors", "a\\b",
                     "model-00001-of-00002.safetensors\x00", "model.safetensors.index.json", "config.json"]),
    st.integers(), st.none(), st.booleans(), st.lists(st.text(max_size=3), max_size=2), st.just({}),
)


@FUZZ
@given(shard=SHARD_NAMES, which=st.integers(0, 10))
@example(shard="model-00001-of-00002.safetensors\x00", which=0)
def test_fuzzed_index_shard_names_end_in_one_line_and_exit_2(sharded, shard, which):
    d, original = sharded
    index = json.loads(json.dumps(original))
    name = list(index["weight_map"])[which]
    index["weight_map"][name] = shard
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    rc, text = run(["diff", str(d), "--prompt-ids", BEYOND])
    assert_one_line(rc, text)
    assert OPENED in text or str(d) in text, text  # the project's error names the file, not just Python's
    assert OPENED not in text or shard == original["weight_map"][name], text


# -- safetensors headers ------------------------------------------------------------------------------

ORIGINAL = (default_checkpoint_path() / "model.safetensors").read_bytes()
N = int.from_bytes(ORIGINAL[:8], "little")


@st.composite
def mutated_files(draw) -> bytes:
    """The fixture's file with its header length changed, header bytes overwritten or removed, or
    bytes added or cut at the end."""
    raw = bytearray(ORIGINAL)
    kind = draw(st.sampled_from(["length", "overwrite", "delete", "tail"]))
    if kind == "length":
        raw[:8] = max(0, N + draw(st.integers(-16, 16))).to_bytes(8, "little")
    elif kind == "overwrite":
        at = draw(st.integers(8, 8 + N - 1))
        raw[at:at + 1] = draw(st.sampled_from([b"0", b"9", b"-", b".", b"e", b"[", b"}", b",", b'"', b"\\", b"\xff"]))
    elif kind == "delete":
        at = draw(st.integers(8, 8 + N - 1))
        del raw[at:at + draw(st.integers(1, 4))]
        raw[:8] = (N - (len(ORIGINAL) - len(raw))).to_bytes(8, "little")
    else:
        cut = draw(st.integers(-8, 8))
        raw = raw[:len(raw) + cut] if cut < 0 else raw + bytes(cut)
    return bytes(raw)


def library_accepts(raw: bytes) -> bool:
    try:
        safetensors.deserialize(raw)
    except Exception:
        return False
    return True


@FUZZ
@given(raw=mutated_files())
def test_fuzzed_safetensors_files_end_in_one_line_and_exit_2(ckpt, raw):
    (ckpt / "config.json").write_text(json.dumps(BASE))
    (ckpt / "model.safetensors").write_bytes(raw)
    rc, text = run(["diff", str(ckpt), "--prompt-ids", BEYOND])
    assert_one_line(rc, text)
    assert "model.safetensors" in text or OPENED in text, text
    if not library_accepts(raw):  # a file the library refuses never opens
        assert OPENED not in text, text

"""A deterministic corpus of malformed inputs, one case per class of defect: files outside the
checkpoint, safetensors files the format refuses, config.json types (nested values too) and keys
naming other math, paths read from files (index shard names, a golden file's checkpoint path),
prompts, golden files, output paths and arguments. Each builder takes a scratch folder and returns
``(argv of parity, what the one-line error must say)``; every file is derived from the bundled
fixture and golden.

The checkpoint cases run ``parity diff CKPT --prompt-ids <id beyond any vocabulary>``: a checkpoint
that opens fails on the prompt instead (``OPENED``), one line and exit 2 either way, and no model is
ever run."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from kimi.checkpoint import open_source
from kimi.fixtures import default_checkpoint_path, write_fixture

SECRET = b"root:x:0:0:SECRET-MARKER-4d1f:/root:/bin/bash\n" * 4
SECRET_MARKERS = ("SECRET-MARKER-4d1f", str(int.from_bytes(SECRET[:8], "little")))
OPENED = "is outside the vocabulary"  # the checkpoint opened: the bad prompt id is what failed
BEYOND = str(2 ** 40)
GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "golden" / "default.json"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
K_PROJ = "model.layers.0.self_attn.k_proj.weight"


def copy_fixture(tmp: Path) -> Path:
    return Path(shutil.copytree(default_checkpoint_path(), tmp / "ckpt"))


def secret_file(tmp: Path) -> Path:
    f = tmp / "outside" / "secret"
    f.parent.mkdir(exist_ok=True)
    f.write_bytes(SECRET)
    return f


def diff(ckpt: Path) -> list[str]:
    return ["diff", str(ckpt), "--prompt-ids", BEYOND]


def split(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(file: Path, header, data: bytes, *, text: bytes | None = None) -> None:
    text = json.dumps(header).encode() if text is None else text
    file.write_bytes(len(text).to_bytes(8, "little") + text + data)


def edit_header(tmp: Path, edit) -> Path:
    d = copy_fixture(tmp)
    f = d / "model.safetensors"
    header, data = split(f)
    edit(header)
    join(f, header, data)
    return d


def edit_config(tmp: Path, edit) -> Path:
    d = copy_fixture(tmp)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def config_text(tmp: Path, replace: tuple[str, str]) -> Path:
    d = copy_fixture(tmp)
    text = (d / "config.json").read_text()
    assert replace[0] in text
    (d / "config.json").write_text(text.replace(*replace, 1))
    return d


# -- leaks from outside the checkpoint ------------------------------------------------------------

def _linked_weights(tmp):
    d = copy_fixture(tmp)
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(secret_file(tmp))
    return diff(d), "model.safetensors: a link to a file outside the checkpoint folder"


def _linked_shard(tmp):
    d = write_fixture("tiny", tmp / "sharded", seed=0, shards=2)
    shard = d / "model-00002-of-00002.safetensors"
    shard.unlink()
    shard.symlink_to(secret_file(tmp))
    return diff(d), "model-00002-of-00002.safetensors: a link to a file outside the checkpoint folder"


def _linked_config(tmp):
    d = copy_fixture(tmp)
    secret = secret_file(tmp).with_name("config.json")
    secret.write_text(json.dumps({"vocab_size": SECRET.decode()}))
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(secret)
    return diff(d), "config.json: a link to a file outside the checkpoint folder"


def _text_as_weights(tmp):  # the first 8 bytes of a text file read as a header length
    d = copy_fixture(tmp)
    (d / "model.safetensors").write_bytes(SECRET)
    return diff(d), "header length field exceeds the format's limit"


def _secret_in_a_header_entry(tmp):
    def edit(h):
        h[Q_PROJ]["dtype"] = SECRET.decode()
    return diff(edit_header(tmp, edit)), f"{Q_PROJ}: dtype: expected a safetensors dtype"


def _secret_in_a_tensor_name(tmp):
    def edit(h):
        h[SECRET.decode()] = h.pop(Q_PROJ)
    return diff(edit_header(tmp, edit)), "missing tensor " + Q_PROJ


# -- safetensors files the library refuses ----------------------------------------------------------

def _aliased(tmp):  # one tensor's bytes reused for another of the same shape
    return diff(edit_header(tmp, lambda h: h[Q_PROJ].update(data_offsets=h[K_PROJ]["data_offsets"]))), \
        f"{Q_PROJ}: data_offsets"


def _shifted(tmp):  # a tensor moved 2 bytes into its neighbour
    def edit(h):
        b, e = h[Q_PROJ]["data_offsets"]
        h[Q_PROJ]["data_offsets"] = [b + 2, e + 2]
    return diff(edit_header(tmp, edit)), "data_offsets"


def _experts_share_a_buffer(tmp):
    def edit(h):
        for e in range(8):
            h[f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"]["data_offsets"] = \
                h["model.layers.1.block_sparse_moe.experts.0.w1.weight"]["data_offsets"]
    return diff(edit_header(tmp, edit)), "overlap"


def _gap(tmp):  # a tensor dropped from the header, its bytes left in place
    return diff(edit_header(tmp, lambda h: h.pop(K_PROJ))), "leave a gap of 8192 bytes"


def _trailing_garbage(tmp):
    d = copy_fixture(tmp)
    with open(d / "model.safetensors", "ab") as f:
        f.write(b"\0" * 6)
    return diff(d), "6 bytes after the last tensor's data"


def _header_length_cut_by_2(tmp):
    d = copy_fixture(tmp)
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[:8] = (n - 2).to_bytes(8, "little")
    f.write_bytes(bytes(raw))
    return diff(d), "model.safetensors: 2 bytes after the last tensor's data"  # the padding absorbed the cut


def _nested_deep(tmp):
    d = copy_fixture(tmp)
    join(d / "model.safetensors", None, b"", text=b"[" * 100_000 + b"]" * 100_000)
    return diff(d), "JSON nested deeper than 127 levels"


def _huge_integer(tmp):
    d = copy_fixture(tmp)
    f = d / "model.safetensors"
    header, data = split(f)
    text = json.dumps(header).replace('"shape": [64, 64]', '"shape": [1' + "0" * 5000 + ', 64]', 1).encode()
    join(f, None, data, text=text)
    return diff(d), "header: not valid JSON (a number out of the float64 range)"


# -- config.json types --------------------------------------------------------------------------------

def _float_count(tmp):
    return diff(edit_config(tmp, lambda c: c.update(num_experts=8.0))), \
        "config.json: num_experts: expected an integer, got the number 8.0"


def _string_flag(tmp):
    return diff(edit_config(tmp, lambda c: c.update(tie_word_embeddings="false"))), \
        "config.json: tie_word_embeddings: expected true or false, got a string of 5 characters"


def _string_renormalize(tmp):
    return diff(edit_config(tmp, lambda c: c.update(moe_renormalize="false"))), "moe_renormalize: expected true or false"


def _bool_count(tmp):
    return diff(edit_config(tmp, lambda c: c.update(num_experts_per_token=True))), \
        "num_experts_per_token: expected an integer, got a boolean"


def _negative_eps(tmp):
    return diff(edit_config(tmp, lambda c: c.update(rms_norm_eps=-1))), "rms_norm_eps: -1.0 is outside its domain"


def _nan_eps(tmp):
    return diff(config_text(tmp, ('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN'))), \
        "config.json: not valid JSON (NaN is not a JSON number)"


def _nan_scaling(tmp):
    return diff(config_text(tmp, ('"routed_scaling_factor": 2.446', '"routed_scaling_factor": NaN'))), \
        "NaN is not a JSON number"


def _billion_layers(tmp):
    return diff(edit_config(tmp, lambda c: c.update(num_hidden_layers=1e9))), \
        "num_hidden_layers: expected an integer, got the number 1000000000.0"


def _billion_layers_int(tmp):
    return diff(edit_config(tmp, lambda c: c.update(num_hidden_layers=10 ** 9))), \
        "num_hidden_layers: 1000000000 is above the limit of 1024"


def _too_many_experts(tmp):
    return diff(edit_config(tmp, lambda c: c.update(num_experts=10 ** 6))), "num_experts: 1000000 is above the limit of 65536"


def _tensor_table_too_large(tmp):  # each size under its limit, their product not
    def edit(c):
        c.update(num_experts=65536, num_hidden_layers=1024)
        c["linear_attn_config"].update(kda_layers=list(range(1, 1025)), full_attn_layers=[])
    return diff(edit_config(tmp, edit)), "make 201151486 tensors, more than the limit of 1000000"


def _vocabulary_too_large(tmp):
    return diff(edit_config(tmp, lambda c: c.update(vocab_size=2 ** 40))), "vocab_size: 1099511627776 is above the limit"


def _layers_holding_lists(tmp):  # every config value is typed before use, nested ones too
    return diff(edit_config(tmp, lambda c: c["linear_attn_config"].update(kda_layers=[[1], [2], [3]]))), \
        "config.json: linear_attn_config.kda_layers[0]: expected an integer, got an array of 1 elements"


def _layers_holding_lists_beside_layer_types(tmp):  # where the two lists are compared as sets
    def edit(c):
        c["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]
        c["linear_attn_config"].update(kda_layers=[[1], [2]], full_attn_layers=[{}])
    return diff(edit_config(tmp, edit)), "linear_attn_config.kda_layers[0]: expected an integer"


def _another_activation(tmp):  # a config describing other math is refused, never run as this model
    return diff(edit_config(tmp, lambda c: c.update(hidden_act="gelu"))), \
        'config.json: hidden_act: expected "silu" (SwiGLU experts and MLP), got a string of 4 characters'


def _softmax_router(tmp):
    return diff(edit_config(tmp, lambda c: c.update(moe_router_activation_func="softmax"))), \
        'moe_router_activation_func: expected "sigmoid"'


def _string_grouped_topk(tmp):
    return diff(edit_config(tmp, lambda c: c.update(use_grouped_topk="true"))), \
        "use_grouped_topk: expected true or false, got a string of 4 characters"


# -- paths read from files -----------------------------------------------------------------------------

def _index_shard(shard, message):
    """A sharded fixture whose index names ``shard`` for its first tensor."""
    def build(tmp):
        d = write_fixture("tiny", tmp / "sharded", seed=0, shards=2)
        f = d / "model.safetensors.index.json"
        index = json.loads(f.read_text())
        index["weight_map"][next(iter(index["weight_map"]))] = shard
        f.write_text(json.dumps(index))
        return diff(d), message
    return build


NOT_A_FILE_NAME = "must be a file name in the directory"
PATH_CASES = {
    "index shard with a NUL byte": _index_shard("model-00001-of-00002.safetensors\x00", NOT_A_FILE_NAME),
    "index shard with a newline": _index_shard("model-00001-of-00002.safetensors\n", NOT_A_FILE_NAME),
    "index shard absolute": _index_shard("/etc/passwd", NOT_A_FILE_NAME),
    "index shard escaping with ..": _index_shard("../sharded/model-00001-of-00002.safetensors", NOT_A_FILE_NAME),
    "index shard ..": _index_shard("..", NOT_A_FILE_NAME),
    "index shard empty": _index_shard("", NOT_A_FILE_NAME),
    "index shard a number": _index_shard(7, "shard: expected a string, got the integer 7"),
    "index shard an array": _index_shard(["a"], "shard: expected a string, got an array of 1 elements"),
    "index shard the index itself": _index_shard("model.safetensors.index.json", "not a safetensors file"),
}


# -- prompts -------------------------------------------------------------------------------------------

def _undecodable_prompt(tmp):  # what Python makes of the argv bytes b"caf\xe9"
    return ["diff", "--prompt", "caf\udce9"], "--prompt: not valid UTF-8 text"


# -- golden files ------------------------------------------------------------------------------------

def golden_case(tmp: Path, edit, *, text_edit=None) -> list[str]:
    g = json.loads(GOLDEN.read_text())
    edit(g)
    text = json.dumps(g)  # allow_nan: NaN/Infinity land in the file as a tampered one would have them
    if text_edit is not None:
        text = text_edit(text)
    f = tmp / "golden.json"
    f.write_text(text)
    return ["golden", "check", str(f)]


def _golden(edit, message, text_edit=None):
    return lambda tmp: (golden_case(tmp, edit, text_edit=text_edit), message)


def _step0(**changes):
    return lambda g: g["steps"][0].update(**changes)


GOLDEN_CASES = {
    "golden without checkpoint": _golden(lambda g: g.pop("checkpoint"), "missing required key 'checkpoint'"),
    "golden config not an object": _golden(lambda g: g.update(config=[]), "config: expected an object, got an array"),
    "golden config with a float count": _golden(lambda g: g["config"].update(num_experts=8.0),
                                                "config: num_experts: expected an integer"),
    "golden without dtype": _golden(lambda g: g.pop("dtype"), "missing required key 'dtype'"),
    "golden dtype unknown": _golden(lambda g: g.update(dtype="int8"), "dtype: expected one of bfloat16, float32"),
    "golden variants not an object": _golden(lambda g: g.update(variants="biased"), "variants: expected an object"),
    "golden top_ids a string": _golden(_step0(top_ids="1,2"), "steps[0].top_ids: expected an array"),
    "golden without top_values": _golden(lambda g: g["steps"][3].pop("top_values"), "steps[3]: missing required key 'top_values'"),
    "golden NaN in top_values": _golden(lambda g: g["steps"][0]["top_values"].__setitem__(2, float("nan")),
                                        "NaN is not a JSON number"),
    "golden Infinity in top_values": _golden(lambda g: g["steps"][0]["top_values"].__setitem__(2, float("inf")),
                                             "Infinity is not a JSON number"),
    "golden top_ids -1": _golden(lambda g: g["steps"][1]["top_ids"].__setitem__(4, -1),
                                 "steps[1].top_ids[4]: -1 is below the minimum 0"),
    "golden top_ids beyond the vocabulary": _golden(lambda g: g["steps"][1]["top_ids"].__setitem__(4, 512),
                                                    "steps[1].top_ids[4]: 512 is above the limit of 511"),
    "golden bound Infinity on every step": _golden(
        lambda g: [s.update(bound=float("inf")) for s in g["steps"]], "Infinity is not a JSON number"),
    "golden bound absurd on every step": _golden(
        lambda g: [s.update(bound=1e300) for s in g["steps"]], "steps[0].bound: 1e+300 is more than float32 rounding noise"),
    "golden bound a thousand times too large": _golden(
        lambda g: [s.update(bound=s["bound"] * 1000) for s in g["steps"]], "is more than float32 rounding noise"),
    "golden bound negative": _golden(_step0(bound=-1e-6), "steps[0].bound: -1e-06 is outside its domain"),
    "golden steps out of order": _golden(lambda g: g["steps"].reverse(), "steps[0].step: expected 0"),
    "golden token not the argmax": _golden(_step0(token=7), "steps[0]: token 7 is not the first of top_ids"),
    "golden weights digest malformed": _golden(lambda g: g.update(weights_sha256="x" * 64), "weights_sha256: expected 64"),
    "golden version a string": _golden(lambda g: g.update(version="1"), "golden format version missing or not an integer"),
    "golden checkpoint path with a NUL byte": _golden(
        lambda g: g.update(checkpoint={"kind": "directory", "path": "/tmp/a\x00b"}),
        "checkpoint.path: a path holding a NUL byte"),
    "golden checkpoint path empty": _golden(lambda g: g.update(checkpoint={"kind": "directory", "path": ""}),
                                            "checkpoint.path: an empty path"),
    "golden with a repeated key": _golden(lambda g: None, "key 'dtype' appears twice in one object",
                                          text_edit=lambda t: t.replace('"dtype": "float32"', '"dtype": "float32", "dtype": "bfloat16"', 1)),
}


# -- output paths and arguments ----------------------------------------------------------------------

def _unwritable_folder(tmp: Path) -> Path | None:
    """A folder this process cannot write into: a read-only one it made, or /proc/sys (read-only
    even for root); None when neither is (the case is skipped)."""
    ro = tmp / "read-only"
    ro.mkdir()
    ro.chmod(0o500)
    if not os.access(ro, os.W_OK):
        return ro
    return Path("/proc/sys") if os.path.isdir("/proc/sys") and not os.access("/proc/sys", os.W_OK) else None


def output_cases(cmd: list[str], flag: str):
    """(name, builder) of every bad output path for ``cmd ... flag PATH``."""
    def case(make, message):
        return lambda tmp: ([*cmd, flag, str(make(tmp))], message)

    def unwritable(tmp):
        folder = _unwritable_folder(tmp)
        if folder is None:
            return None
        return [*cmd, flag, str(folder / "out.json")], "is not writable"

    return {
        f"{' '.join(cmd[:2])} {flag} a directory": case(lambda tmp: tmp, "is a directory"),
        f"{' '.join(cmd[:2])} {flag} in a missing folder": case(lambda tmp: tmp / "no" / "out.json", "does not exist"),
        f"{' '.join(cmd[:2])} {flag} a name too long": case(lambda tmp: tmp / ("x" * 300 + ".json"),
                                                            "longer than the file system's limit"),
        f"{' '.join(cmd[:2])} {flag} empty": lambda tmp: ([*cmd, flag, ""], f"{flag}: empty path"),
        f"{' '.join(cmd[:2])} {flag} unwritable": unwritable,
    }


CASES = {
    "weights linked outside": _linked_weights,
    "index shard linked outside": _linked_shard,
    "config linked outside": _linked_config,
    "a text file as weights": _text_as_weights,
    "file content in a header entry": _secret_in_a_header_entry,
    "file content as a tensor name": _secret_in_a_tensor_name,
    "aliased offsets": _aliased,
    "tensor shifted 2 bytes": _shifted,
    "eight experts on one buffer": _experts_share_a_buffer,
    "gap in the data": _gap,
    "trailing garbage": _trailing_garbage,
    "header length cut by 2": _header_length_cut_by_2,
    "header nested 100,000 deep": _nested_deep,
    "5,000-digit integer": _huge_integer,
    "num_experts 8.0": _float_count,
    'tie_word_embeddings "false"': _string_flag,
    'moe_renormalize "false"': _string_renormalize,
    "num_experts_per_token true": _bool_count,
    "rms_norm_eps -1": _negative_eps,
    "rms_norm_eps NaN": _nan_eps,
    "routed_scaling_factor NaN": _nan_scaling,
    "num_hidden_layers 1e9": _billion_layers,
    "num_hidden_layers 10**9": _billion_layers_int,
    "num_experts 10**6": _too_many_experts,
    "vocab_size 2**40": _vocabulary_too_large,
    "experts x layers: 2e8 tensors": _tensor_table_too_large,
    "kda_layers holding lists": _layers_holding_lists,
    "kda_layers holding lists beside layer_types": _layers_holding_lists_beside_layer_types,
    "hidden_act gelu": _another_activation,
    "moe_router_activation_func softmax": _softmax_router,
    'use_grouped_topk "true"': _string_grouped_topk,
    **PATH_CASES,
    "prompt not UTF-8": _undecodable_prompt,
    **GOLDEN_CASES,
    **output_cases(["golden", "check", str(GOLDEN)], "--json"),
    **output_cases(["certify", "--ops", "elementwise.silu"], "--json"),
    **output_cases(["golden", "record"], "--out"),
    **output_cases(["diff"], "--plot"),
    "certify --examples 1e20": lambda tmp: (["certify", "--examples", "1e20"], "argument --examples: invalid int value"),
    "certify --examples 10**20": lambda tmp: (["certify", "--examples", str(10 ** 20)],
                                              "--examples 100000000000000000000: more than the limit of 10000 examples"),
    "diff --steps 10**9": lambda tmp: (["diff", "--steps", str(10 ** 9)], "more than the limit of 100000 steps"),
    "golden record --top-k 10**6": lambda tmp: (["golden", "record", "--out", str(tmp / "g.json"), "--top-k", "1000000"],
                                                "--top-k 1000000: expected 2 to 4096"),
    "fixture OUT_DIR empty": lambda tmp: (["fixture", "tiny", ""], "OUT_DIR: empty path"),
    "diff --seed -1": lambda tmp: (["diff", "--synthetic", "tiny", "--seed", "-1"], "--seed: expected 0 <= S < 2**32"),
}


def legitimate_hub_snapshot(tmp: Path, config_edit=None) -> Path:
    """The bundled fixture as the hub cache lays it out: ``snapshots/<rev>/`` holding relative links
    into ``blobs/`` (optionally with an edited config)."""
    repo = tmp / "hub" / "models--org--kimi-tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, name in enumerate(("config.json", "model.safetensors")):
        blob = blobs / f"{i:040x}"
        shutil.copyfile(default_checkpoint_path() / name, blob)
        if name == "config.json" and config_edit is not None:
            cfg = json.loads(blob.read_text())
            config_edit(cfg)
            blob.write_text(json.dumps(cfg))
        (snap / name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    open_source(snap)  # it opens
    return snap

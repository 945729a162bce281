"""The shared input-validation layer: strict JSON, typed field readers, safe error text, confined
paths and output files. (Every entry point's use of it: tests/malformed.)"""
import math
import os

import numpy as np
import pytest

from kimi.validate import (InvalidInput, as_bool, as_file_name, as_float, as_int, as_list, as_path, as_str,
                                check_finite, inside, json_depth, label, one_line, output_file, parse_json)


@pytest.mark.parametrize("text, message", [
    ('{"a": NaN}', "NaN is not a JSON number"),
    ('{"a": -Infinity}', "-Infinity is not a JSON number"),
    ('{"a": 1e400}', "a number out of the float64 range"),
    ('{"a": 1, "a": 2}', "key 'a' appears twice in one object"),
    ('{"a": "\\ud800"}', "a string holds a lone surrogate escape"),
    ("[" * 200 + "]" * 200, "JSON nested deeper than 127 levels"),
    ('{"a": }', "not valid JSON (Expecting value at line 1 column 7)"),
    (b'{"a": "\xff"}', "not UTF-8 text (invalid byte at offset 7)"),
])
def test_parse_json_refuses_what_json_does_not_define_or_cannot_mean_one_thing(text, message):
    with pytest.raises(InvalidInput, match=r"^f\.json: ") as e:
        parse_json(text, what="f.json")
    assert message in str(e.value)


def test_parse_json_reads_integers_as_serde_does():
    v = parse_json('[18446744073709551615, 18446744073709551616, -0, %s]' % ("1" * 300), what="x")
    assert v[0] == 2 ** 64 - 1 and isinstance(v[0], int)
    assert isinstance(v[1], float) and isinstance(v[2], float) and math.copysign(1, v[2]) == -1
    assert isinstance(v[3], float)  # never Python's unbounded int (a 5,000-digit one raises ValueError)
    with pytest.raises(InvalidInput, match="a number out of the float64 range"):
        parse_json("[%s]" % ("1" * 5000), what="x")


def test_json_depth_ignores_brackets_inside_strings():
    assert json_depth('{"a": ["[[[", {"b": "}}"}]}') == 3
    assert json_depth("[" * 100_000) == 100_000


@pytest.mark.parametrize("reader, value, message", [
    (lambda v: as_int(v, "n", hi=8), 8.0, "n: expected an integer, got the number 8.0"),
    (lambda v: as_int(v, "n", hi=8), True, "n: expected an integer, got a boolean"),
    (lambda v: as_int(v, "n", hi=8), 9, "n: 9 is above the limit of 8"),
    (lambda v: as_int(v, "n", lo=1), 0, "n: 0 is below the minimum 1"),
    (lambda v: as_bool(v, "flag"), "false", "flag: expected true or false, got a string of 5 characters"),
    (lambda v: as_float(v, "eps", lo=0.0, lo_open=True), -1, "eps: -1.0 is outside its domain (expected > 0.0)"),
    (lambda v: as_float(v, "eps"), math.nan, "eps: expected a finite number, got a non-finite number"),
    (lambda v: as_str(v, "dtype", choices=("a", "b")), "secret text", "dtype: expected one of a, b"),
    (lambda v: as_list(v, "ids", max_len=2), [1, 2, 3], "ids: 3 elements, more than the limit of 2"),
    (lambda v: as_path(v, "path"), "secret\x00/x", "path: a path holding a NUL byte"),
    (lambda v: as_path(v, "path"), " ", "path: an empty path"),
    (lambda v: as_path(v, "path"), ["secret"], "path: expected a string, got an array of 1 elements"),
])
def test_field_readers_name_the_field_and_never_echo_a_string(reader, value, message):
    with pytest.raises(InvalidInput) as e:
        reader(value)
    assert str(e.value) == message and "secret" not in str(e.value)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "/etc/passwd", "../x", "a\\b", "x\x00", "x\n", "\x7f"])
def test_a_file_name_read_from_a_file_names_a_file_of_the_folder_and_nothing_else(name):
    with pytest.raises(InvalidInput, match=r"^shard: '.*' must be a file name in the directory$"):
        as_file_name(name, "shard")
    with pytest.raises(InvalidInput, match=r"^shard: expected a string, got the integer 7$"):
        as_file_name(7, "shard")
    assert as_file_name("model-00001-of-00002.safetensors", "shard") == "model-00001-of-00002.safetensors"


def test_labels_and_lines_are_escaped_and_short():
    assert label("ok.name") == "ok.name"
    assert label("a\nb\udce9\xe9") == "a\\x0ab\\udce9\\xe9"
    assert label("x" * 100, 10) == "xxxxxxxxxx...(100 characters)"
    assert one_line("path\nwith newline \xe9") == "path\\x0awith newline \xe9"


def test_check_finite_gives_the_count_and_first_index_not_the_values():
    a = np.zeros((3, 4))
    a[1, 2] = np.inf
    a[2, 0] = np.nan
    with pytest.raises(InvalidInput, match=r"^w: 2 non-finite values \(first at index \(1, 2\)\)$"):
        check_finite(a, "w")
    assert check_finite(np.ones(3), "w") is not None


def test_inside_follows_links_within_the_folder_and_a_hub_snapshot_into_its_blobs(tmp_path):
    repo = tmp_path / "models--a--b"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "rev"
    snap.mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("{}")
    (snap / "config.json").symlink_to("../../blobs/abc")
    (snap / "local").write_text("x")
    (snap / "alias").symlink_to("local")
    assert inside(snap, "config.json") == snap / "config.json"
    assert inside(snap, "alias") == snap / "alias"
    assert inside(snap, "missing") == snap / "missing"
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("rev")
    (snap / "ref").symlink_to("../../refs/main")
    with pytest.raises(InvalidInput, match=r"rev/ref: a link to a file outside the checkpoint folder"):
        inside(snap, "ref")
    (snap / "loop").symlink_to("loop")
    with pytest.raises(InvalidInput, match="does not resolve"):
        inside(snap, "loop")
    with pytest.raises(InvalidInput, match=r"rev/a\\x00b: a path holding a NUL byte$"):
        inside(snap, "a\x00b")


def test_an_output_file_is_checked_before_any_work(tmp_path):
    assert output_file("--json", None) is None
    assert output_file("--json", str(tmp_path / "r.json")) == tmp_path / "r.json"
    for path, message in [("", "--json: empty path"), (str(tmp_path), "is a directory"),
                          (str(tmp_path / "no" / "r.json"), "does not exist"),
                          (str(tmp_path / ("x" * 256)), "longer than the file system's limit"),
                          ("/dev/null", "exists and is not a regular file")]:
        with pytest.raises(InvalidInput) as e:
            output_file("--json", path)
        assert message in str(e.value), (path, str(e.value))
    if not os.access("/proc/sys", os.W_OK) and os.path.isdir("/proc/sys"):
        with pytest.raises(InvalidInput, match="is not writable"):
            output_file("--json", "/proc/sys/r.json")

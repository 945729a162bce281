"""The tagged-safetensors container (parity.files): what it writes reads back, and a file of another
format, another version, a cut header, a file that is no safetensors, a header without the tag or
against the schema are each refused with one line naming the file, raised as the format's error."""
import dataclasses

import pytest
import torch
from safetensors.torch import save, save_file

from parity import files
from parity.errors import InputError


class ToyError(InputError):
    """The toy format's own error: the container raises the format's class."""


# the calls schema, whose smallest valid header is short
TOY = files.Format("kimi-parity/calls", 1, schema="calls", noun="toy file", error=ToyError)
FIELDS = {"part": False, "run": {"targets": {}, "max_bytes": 0}, "calls": []}


def _refused(path, fmt=TOY) -> str:
    with pytest.raises(ToyError) as info:
        files.read_header(path, fmt)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    return msg


def test_a_written_file_reads_back_with_its_header_and_tensors(tmp_path):
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    path = files.write(tmp_path / "a.safetensors", TOY, FIELDS, {"x": x})
    got = files.read_header(path, TOY)
    assert got.head == {"format": "kimi-parity/calls", "version": 1, **FIELDS}
    assert list(got.head)[:2] == ["format", "version"]       # the tag opens the header
    assert (got.tensors["x"].dtype, got.tensors["x"].shape) == ("F32", (2, 3))
    assert [p.name for p in tmp_path.iterdir()] == ["a.safetensors"]   # no temporary file left


def test_another_format_and_another_version_are_named_with_the_expected_one(tmp_path):
    other = files.write(tmp_path / "o.safetensors", dataclasses.replace(TOY, tag="kimi-parity/cases"), FIELDS, {})
    assert _refused(other).endswith(": format 'kimi-parity/cases', expected 'kimi-parity/calls'")
    newer = files.write(tmp_path / "v.safetensors", dataclasses.replace(TOY, version=2), FIELDS, {})
    assert _refused(newer).endswith(": calls format version 2; this tool reads 1")


def test_a_cut_header_and_a_file_that_is_no_safetensors_are_refused(tmp_path):
    whole = files.write(tmp_path / "w.safetensors", TOY, FIELDS, {}).read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(whole[:40])
    assert "truncated" in _refused(cut)
    text = tmp_path / "notes.safetensors"
    text.write_text("these are notes, not tensors\n")
    assert "not a safetensors file" in _refused(text)
    stub = tmp_path / "stub.safetensors"
    stub.write_bytes(b"\x05\x00")
    assert "truncated file (2 bytes" in _refused(stub)


def test_a_safetensors_file_without_the_tag_or_off_its_schema_is_refused(tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    assert _refused(plain).endswith(": not a kimi-parity toy file (no 'kimi-parity' entry in the safetensors metadata)")
    odd = tmp_path / "odd.safetensors"
    save_file({}, str(odd), metadata={files.METADATA_KEY: "[1, 2"})
    assert "the 'kimi-parity' metadata" in _refused(odd)
    off = files.write(tmp_path / "off.safetensors", TOY, {**FIELDS, "calls": "none"}, {})
    assert ": header: " in _refused(off)
    assert files.read_header(off, TOY, schema=False).head["calls"] == "none"


def test_a_header_that_is_no_strict_json_is_never_written(tmp_path):
    with pytest.raises(ValueError):
        files.write(tmp_path / "nan.safetensors", TOY, {**FIELDS, "x": float("nan")}, {})
    assert list(tmp_path.iterdir()) == []


def test_the_tensors_alone_are_plain_safetensors(tmp_path):
    path = files.write_tensors(tmp_path / "t.safetensors", {"x": torch.ones(3)})
    assert path.read_bytes() == save({"x": torch.ones(3)})
    assert "not a kimi-parity toy file" in _refused(path)


def test_a_file_not_forced_to_disk_has_the_same_bytes(tmp_path):
    tensors = {"b": torch.ones(2, 3, dtype=torch.bfloat16), "a": torch.arange(3), "e": torch.zeros(0)}
    fast = files.write_tensors(tmp_path / "fast.safetensors", tensors, {"k": "v"}, durable=False)
    assert fast.read_bytes() == save(tensors, metadata={"k": "v"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fast.safetensors"]

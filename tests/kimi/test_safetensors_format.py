"""The safetensors header reader accepts exactly what the safetensors library accepts: a table of
cases (one per rule of the format, and each trick of serde_json the library inherits), then a
hypothesis fuzzer that renders near-valid headers and compares both readers on each."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi.safetensors_format import DTYPE_BITS, parse_header
from kimi.validate import InvalidInput

safetensors = pytest.importorskip("safetensors", reason="the safetensors library is the oracle of these tests")

E = '"dtype":"F32","shape":[1],"data_offsets":[0,4]'


def library_accepts(text: bytes, data_size: int) -> bool:
    try:
        safetensors.deserialize(len(text).to_bytes(8, "little") + text + bytes(data_size))
    except Exception:  # the library raises SafetensorError (and ValueError for some cases)
        return False
    return True


def we_accept(text: bytes, data_size: int) -> bool:
    try:
        parse_header(text, data_size)
    except InvalidInput as exc:
        msg = str(exc)
        assert "\n" not in msg and len(msg) < 400, msg
        return False
    return True


CASES = {  # name: (header text, data size)
    "one tensor": ('{"t":{%s}}' % E, 4),
    "empty header": ("{}", 0),
    "metadata of strings": ('{"__metadata__":{"format":"pt"},"t":{%s}}' % E, 4),
    "metadata null": ('{"__metadata__":null,"t":{%s}}' % E, 4),
    "metadata integer value": ('{"__metadata__":{"a":1},"t":{%s}}' % E, 4),
    "metadata array": ('{"__metadata__":[],"t":{%s}}' % E, 4),
    "metadata twice": ('{"__metadata__":{"a":"b"},"__metadata__":{"a":"c"}}', 0),
    "metadata key repeated": ('{"__metadata__":{"a":"b","a":"c"}}', 0),
    "unknown entry field": ('{"t":{%s,"x":[1,{"y":null}]}}' % E, 4),
    "positional entry": ('{"t":["F32",[1],[0,4]]}', 4),
    "positional entry of 2": ('{"t":["F32",[1]]}', 4),
    "positional entry of 4": ('{"t":["F32",[1],[0,4],0]}', 4),
    "dtype as object": ('{"t":{"dtype":{"F32":null},"shape":[1],"data_offsets":[0,4]}}', 4),
    "dtype object with a value": ('{"t":{"dtype":{"F32":[]},"shape":[1],"data_offsets":[0,4]}}', 4),
    "dtype object of 2 keys": ('{"t":{"dtype":{"F32":null,"F16":null},"shape":[1],"data_offsets":[0,4]}}', 4),
    "dtype lower case": ('{"t":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}}', 4),
    "dtype number": ('{"t":{"dtype":1,"shape":[1],"data_offsets":[0,4]}}', 4),
    "repeated tensor, last counts": ('{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                     '"t":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}', 4),
    "repeated tensor, last invalid": ('{"t":{%s},"t":{"dtype":"F16","shape":[1],"data_offsets":[0,4]}}' % E, 4),
    "repeated field": ('{"t":{%s,"dtype":"F32"}}' % E, 4),
    "repeated unknown field": ('{"t":{%s,"x":1,"x":2}}' % E, 4),
    "missing shape": ('{"t":{"dtype":"F32","data_offsets":[0,4]}}', 4),
    "shape null": ('{"t":{"dtype":"F32","shape":null,"data_offsets":[0,4]}}', 4),
    "shape float": ('{"t":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}', 4),
    "shape exponent": ('{"t":{"dtype":"F32","shape":[1e0],"data_offsets":[0,4]}}', 4),
    "shape negative zero": ('{"t":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}', 0),
    "shape bool": ('{"t":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}', 4),
    "shape string": ('{"t":{"dtype":"F32","shape":["1"],"data_offsets":[0,4]}}', 4),
    "shape 2**64": ('{"t":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,4]}}', 4),
    "shape overflows before a 0": ('{"t":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}', 0),
    "size overflows": ('{"t":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,0]}}', 0),
    "scalar": ('{"t":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}', 4),
    "F4 of 3 elements": ('{"t":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}', 2),
    "F4 of 4 elements": ('{"t":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}', 2),
    "three offsets": ('{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4,4]}}', 4),
    "offsets object": ('{"t":{"dtype":"F32","shape":[1],"data_offsets":{"0":0,"1":4}}}', 4),
    "gap before": ('{"t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', 8),
    "trailing data": ('{"t":{%s}}' % E, 5),
    "truncated data": ('{"t":{%s}}' % E, 3),
    "overlap": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', 8),
    "aliased": ('{"a":{%s},"b":{%s}}' % (E, E), 4),
    "zero-size tensors share an offset": ('{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
                                          '"b":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}', 0),
    "offsets reversed": ('{"t":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}}', 4),
    "top-level array": ("[]", 0),
    "top-level null": ("null", 0),
    "entry null": ('{"t":null}', 4),
    "NaN": ('{"t":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}}', 4),
    "number out of range": ('{"t":{%s,"x":1e400}}' % E, 4),
    "400-digit integer": ('{"t":{%s,"x":1%s}}' % (E, "0" * 400), 4),
    "30-digit integer": ('{"t":{%s,"x":1%s}}' % (E, "0" * 30), 4),
    "5000-digit integer": ('{"t":{"dtype":"F32","shape":[1%s],"data_offsets":[0,4]}}' % ("0" * 5000), 4),
    "lone surrogate in a name": ('{"\\ud800":{%s}}' % E, 4),
    "lone trailing surrogate in a key": ('{"t":{%s,"\\udc00":1}}' % E, 4),
    "lone surrogate in metadata": ('{"__metadata__":{"a":"\\udc00"}}', 0),
    "surrogate pair": ('{"\\ud83d\\ude00":{%s}}' % E, 4),
    "escaped NUL in a name": ('{"t\\u0000":{%s}}' % E, 4),
    "raw control character": ('{"t\x01":{%s}}' % E, 4),
    "byte order mark": ("\ufeff{}", 0),
    "trailing whitespace": ("{}  \n\t\r", 0),
    "trailing form feed": ("{}\f", 0),
    "plus sign": ('{"t":{"dtype":"F32","shape":[+1],"data_offsets":[0,4]}}', 4),
    "leading zero": ('{"t":{"dtype":"F32","shape":[01],"data_offsets":[0,4]}}', 4),
    "nested 125 deep in an ignored field": ('{"t":{%s,"x":%s}}' % (E, "[" * 125 + "]" * 125), 4),
    "nested 126 deep in an ignored field": ('{"t":{%s,"x":%s}}' % (E, "[" * 126 + "]" * 126), 4),
    "nested 100,000 deep": ("[" * 100_000 + "]" * 100_000, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_we_accept_a_header_exactly_when_the_library_does(case):
    text, size = CASES[case]
    data = text.encode("utf-8")
    assert we_accept(data, size) == library_accepts(data, size)


def test_every_dtype_of_the_library_is_known_with_its_width():
    for code, bits in DTYPE_BITS.items():
        n = 8 // bits * 8 if bits < 8 else 1
        text = json.dumps({"t": {"dtype": code, "shape": [n], "data_offsets": [0, n * bits // 8]}}).encode()
        assert library_accepts(text, n * bits // 8) and we_accept(text, n * bits // 8), code


# -- the fuzzer -------------------------------------------------------------------------------------

NUMBERS = st.one_of(st.integers(0, 40).map(str), st.sampled_from(
    ["-0", "-1", "1.0", "1e0", "0.5", "18446744073709551615", "18446744073709551616", "1" + "0" * 30,
     "1e400", "NaN", "true", "null", '"4"', "[]", "{}"]))
NAMES = st.sampled_from(["a", "b", "t", "__metadata__", "\\ud800", "\\u00e9", "", "x\\u0000"])
DTYPES = st.one_of(st.sampled_from(sorted(DTYPE_BITS)).map(json.dumps),
                   st.sampled_from(['"f32"', '{"F16":null}', '{"F32":[]}', "1", "null"]))


def _render(pairs) -> str:
    return "{" + ",".join(f'"{k}":{v}' for k, v in pairs) + "}"


@st.composite
def headers(draw):
    """(header text, data size): a few tensors laid out contiguously, then perturbed: numbers
    replaced, offsets shifted, fields dropped, repeated or reordered, entries written positionally."""
    pos, entries = 0, []
    for _ in range(draw(st.integers(0, 4))):
        code = draw(st.sampled_from(["F32", "BF16", "U8", "F4", "F64"]))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        n = 1
        for s in shape:
            n *= s
        size = n * DTYPE_BITS[code] // 8
        fields = [("dtype", json.dumps(code)), ("shape", json.dumps(shape)),
                  ("data_offsets", json.dumps([pos, pos + size]))]
        pos += size
        if draw(st.booleans()):  # perturb one field
            k = draw(st.integers(0, 2))
            values = DTYPES if k == 0 else st.one_of(
                NUMBERS.map(lambda x: f"[{x}]"), NUMBERS.map(lambda x: f"[0,{x}]"), NUMBERS)
            fields[k] = (fields[k][0], draw(values))
        if draw(st.integers(0, 4)) == 0:
            fields.append((draw(st.sampled_from(["x", "dtype", "shape"])), draw(NUMBERS)))
        if draw(st.integers(0, 5)) == 0:
            fields.pop(draw(st.integers(0, len(fields) - 1)))
        fields = draw(st.permutations(fields))
        if draw(st.integers(0, 5)) == 0 and len(fields) == 3:
            value = "[" + ",".join(v for _, v in fields) + "]"
        else:
            value = _render(fields)
        entries.append((draw(NAMES), value))
    if draw(st.integers(0, 3)) == 0:
        entries.insert(0, ("__metadata__", draw(st.sampled_from(['{"format":"pt"}', "null", '{"a":1}', "[]", '""']))))
    return _render(entries), max(0, pos + draw(st.sampled_from([0, 0, 0, -1, 1, 2])))


@settings(max_examples=20 * settings.default.max_examples)
@given(case=headers())
def test_fuzzed_headers_are_accepted_exactly_when_the_library_accepts_them(case):
    text, size = case
    data = text.encode("utf-8")
    assert we_accept(data, size) == library_accepts(data, size), text

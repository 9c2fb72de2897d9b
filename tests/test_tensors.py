"""shmshare.tensors: descriptors and nested batches round-trip through msgpack."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from shmshare import tensors
from shmshare.tensors import ArrayDesc, decode, encode

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
          np.uint64, np.float16, np.float32, np.float64, np.longdouble, np.complex64,
          np.complex128, ">i4", "<f8", "U7", "S5", "V12", "M8[ns]", "m8[s]",
          [("a", "<i4"), ("b", "<f8", (2,))],
          np.dtype([("x", "u1"), ("y", "<i8")], align=True)]


class Arena:
    """A bytearray standing in for a segment: place() copies arrays in, view() maps them out."""

    def __init__(self):
        self.mem = bytearray(1 << 16)
        self.used = 0

    def place(self, arr):
        arr, tdt = tensors.as_numpy(arr)
        _lo, nbytes = tensors.span(arr.itemsize, arr.shape, arr.strides)
        start = self.used
        self.used += (nbytes + 63) // 64 * 64
        dst = np.ndarray(arr.shape, arr.dtype, buffer=self.mem, offset=start)
        dst[...] = arr
        return ArrayDesc(0, start, start, tensors.encode_dtype(arr.dtype), arr.shape,
                         dst.strides, tdt)

    def view(self, segment, block, offset, layout):
        return np.ndarray(layout.shape, layout.dtype, buffer=self.mem, offset=offset,
                          strides=layout.strides)


def roundtrip(obj):
    arena = Arena()
    return decode(encode(obj, arena.place), arena.view)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_fixed_size_dtype_round_trips(dtype):
    dt = np.dtype(dtype)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=dt.itemsize * 6, dtype=np.uint8).tobytes()
    arr = np.frombuffer(raw, dtype=dt).reshape(2, 3)
    got = roundtrip(arr)
    assert got.dtype == dt and got.shape == (2, 3)
    if dt.names:  # padding bytes between fields are not data
        assert all(got[n].tobytes() == arr[n].tobytes() for n in dt.names)
    else:
        assert got.tobytes() == arr.tobytes()


def test_nested_batches_keep_their_structure():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    batch = {"x": a, "meta": {"ids": [1, 2, 3], "name": "b0", "none": None, 5: b"raw"},
             "pair": (a[:, 1], 2.5, True), "list": [np.zeros(0), np.float32(1.5), np.int64(-3)]}
    got = roundtrip(batch)
    assert set(got) == {"x", "meta", "pair", "list"}
    np.testing.assert_array_equal(got["x"], a)
    assert got["meta"] == {"ids": [1, 2, 3], "name": "b0", "none": None, 5: b"raw"}
    assert isinstance(got["pair"], tuple) and got["pair"][1:] == (2.5, True)
    np.testing.assert_array_equal(got["pair"][0], a[:, 1])
    assert got["list"][0].shape == (0,)
    assert got["list"][1] == np.float32(1.5) and got["list"][1].dtype == np.float32
    assert got["list"][2] == -3 and got["list"][2].dtype == np.int64


def test_keys_subclasses_and_scalars_come_back_as_plain_values():
    import enum

    class Color(enum.IntEnum):
        RED = 1

    class Name(str, enum.Enum):  # noqa: UP042 - the mixin, not StrEnum, is what is tested
        RED = "red"

    class Loud(str):
        def __str__(self):
            return "LOUD"

    class Half(float):
        def __float__(self):
            return 0.5

    class Tagged(dict):
        def keys(self):
            raise AssertionError("packing must not run the subclass's methods")

        __iter__ = keys

    got = roundtrip({(1, "a"): np.arange(3), 2.5: None, "c": Color.RED, "t": Tagged(a=1),
                     "f": np.float64(0.5), "b": np.bool_(True), "n": Name.RED,
                     "l": Loud("quiet"), "h": Half(2.0), "v": np.void(b"ab")})
    np.testing.assert_array_equal(got[(1, "a")], np.arange(3))
    assert got[2.5] is None and got["c"] == 1 and type(got["c"]) is int
    assert got["t"] == {"a": 1} and type(got["t"]) is dict
    assert type(got["f"]) is np.float64 and type(got["b"]) is np.bool_
    assert (got["n"], got["l"], got["h"]) == ("red", "quiet", 2.0)  # the values, not __str__
    assert got["v"].tobytes() == b"ab"


def test_an_ordered_dict_keeps_its_order():
    import collections

    od = collections.OrderedDict(a=1, b=2, c=3)
    od.move_to_end("a")
    assert list(roundtrip({"od": od})["od"]) == ["b", "c", "a"]


def test_deeply_nested_tuples_round_trip_and_too_deep_is_an_error_not_a_crash():
    deep = ()
    for _ in range(400):  # nested unpackers would have run out of C stack well before this
        deep = (deep, 1)
    got = roundtrip({"t": deep})["t"]
    depth = 0
    while got:
        assert type(got) is tuple and got[1] == 1
        got, depth = got[0], depth + 1
    assert depth == 400
    for _ in range(5000):
        deep = (deep,)
    with pytest.raises(TypeError, match="recursion limit"):
        encode({"t": deep}, Arena().place)
    hostile = b"\x92\xc7\x00\x02" * 100_000 + b"\xc0"  # tuple markers nested 100,000 deep
    with pytest.raises(ValueError, match="malformed batch"):
        decode(hostile, lambda *a: None)


def test_pack_desc_matches_the_descriptor_and_layouts_are_shared():
    d = ArrayDesc(3, 9, -8, "<i4", (2, 3), (12, -4), "bfloat16")
    assert tensors.pack_desc(3, 9, -8, b"<i4", (2, 3), (12, -4), b"bfloat16") == d.pack()
    assert ArrayDesc.unpack(d.pack().data) == d
    seg, block, off, lay = tensors.parse_desc(d.pack().data)
    assert (seg, block, off) == (3, 9, -8)
    assert lay == (np.dtype("<i4"), (2, 3), (12, -4), "bfloat16", -8, 24, False)
    assert tensors.parse_desc(ArrayDesc(1, 1, 0, "<i4", (2, 3), (12, 4)).pack().data)[3].dense
    other = tensors.parse_desc(ArrayDesc(4, 10, 64, "<i4", (2, 3), (12, -4), "bfloat16").pack().data)
    assert other[:3] == (4, 10, 64) and other[3] is lay  # parsed once
    with pytest.raises(ValueError, match="malformed dtype"):
        tensors.parse_desc(ArrayDesc(1, 1, 0, "not-a-dtype", (1,), (1,)).pack().data)
    # np.ndarray((-1,), "S0") is a SIGFPE in numpy, np.empty((2, 2, 2**63 - 1), "V0") has size -4
    for shape in [(-1,), (2, -3), (1,) * 65, (2, 2, 2**63 - 1)]:
        with pytest.raises(ValueError, match="at most 64 dimensions, none negative"):
            tensors.parse_desc(ArrayDesc(1, 1, 0, "|S0", shape, (0,) * len(shape)).pack().data)


def test_descriptor_keeps_strides_and_span():
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    v = base[::-2, 1::2]
    lo, n = tensors.span(4, v.shape, v.strides)
    assert lo == -48 and n == 48 + 16 + 4
    d = ArrayDesc(3, 9, 100, "<i4", v.shape, v.strides)
    assert ArrayDesc.unpack(d.pack().data) == d
    assert d.nbytes == 68
    assert tensors.span(4, (0, 5), (20, 4)) == (0, 0)


@pytest.mark.parametrize("bad, match", [
    (np.array([object()]), "object references"),
    (np.array([(1, None)], dtype=[("a", "i4"), ("b", "O")]), "object references"),
    ({"k": {1, 2}}, r"batch\['k'\]: a builtins.set cannot be sent"),
    ({"n": [1, 1 << 70]}, r"batch\['n'\]\[1\]: 1180591620717411303424 does not fit 64 bits"),
    ({frozenset(): 3}, r"batch key frozenset\(\): a builtins.frozenset cannot be sent"),
    ([lambda: 0], r"batch\[0\]: a builtins.function"),
])
def test_what_cannot_be_sent_is_refused_by_path(bad, match):
    def place(arr):
        tensors.check_shareable(arr.dtype)
        raise AssertionError("unreachable")

    with pytest.raises(TypeError, match=match):
        encode(bad, place)


def test_malformed_descriptors_and_exts():
    with pytest.raises(ValueError, match="malformed array descriptor"):
        ArrayDesc.unpack(msgpack.packb([1, 2]))
    with pytest.raises(ValueError, match="unknown ext code 9"):
        decode(msgpack.packb(msgpack.ExtType(9, b"")), lambda *a: None)
    with pytest.raises(ValueError, match="malformed batch"):
        decode(b"\x92\x01", lambda *a: None)  # a list of two with one item
    with pytest.raises(ValueError, match="malformed dtype"):
        tensors.decode_dtype("not-a-dtype")
    with pytest.raises(ValueError, match="malformed dtype 'D\\(\\)'"):
        tensors.decode_dtype("D()")  # numpy raises IndexError for this one


def test_torch_tensors_including_bfloat16():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    arr, name = tensors.as_numpy(t)
    assert name == "bfloat16" and arr.dtype == np.int16
    assert tensors.is_torch_tensor(t) and not tensors.is_torch_tensor(arr)
    got = roundtrip({"t": t.t()})  # non-contiguous
    desc_view = got["t"]
    back = torch.from_numpy(np.ascontiguousarray(desc_view)).view(torch.bfloat16)
    assert torch.equal(back, t.t().contiguous())
    with pytest.raises(TypeError, match="on meta cannot go through shared memory"):
        tensors.as_numpy(torch.empty(2, device="meta"))


@pytest.mark.parametrize("tree", [msgpack.ExtType(2, b""), {"a": msgpack.ExtType(2, b"")},
                                  [1, msgpack.ExtType(2, b"")],
                                  [msgpack.ExtType(2, b""), msgpack.ExtType(2, b"")]],
                         ids=["alone", "dict-value", "not-first", "twice"])
def test_a_tuple_marker_out_of_place_is_a_malformed_batch(tree):
    # Found by review: a lone marker came back to the user as a _TupleMark object.
    with pytest.raises(ValueError, match="tuple marker out of place"):
        tensors.decode(msgpack.packb(tree), lambda *a: None)

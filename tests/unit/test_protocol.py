import pickle

import numpy as np
import pytest
import torch

from hybridflow.protocol import Batch


def make(n=6, meta=None):
    return Batch.from_dict(
        tensors={
            "ids": torch.arange(n * 3).reshape(n, 3),
            "mask": torch.arange(n) % 2 == 0,
            "logp": torch.linspace(0, 1, n, dtype=torch.bfloat16),
        },
        non_tensors={"uid": [f"u{i}" for i in range(n)], "extra": [{"i": i} for i in range(n)]},
        meta=meta or {"step": 1},
    )


def assert_batch_equal(a, b):
    assert a.keys() == b.keys()
    for k in a.tensors:
        assert a.tensors[k].dtype == b.tensors[k].dtype, k
        assert torch.equal(a.tensors[k], b.tensors[k]), k
    for k in a.non_tensors:
        assert a.non_tensors[k].dtype == b.non_tensors[k].dtype, k
        assert list(a.non_tensors[k]) == list(b.non_tensors[k]), k
    assert a.meta == b.meta


# ------------------------------------------------------------- construction
def test_length_mismatch_names_key():
    with pytest.raises(ValueError, match=r"tensor 'b' has leading dim 3, expected 4 \(from 'a'\)"):
        Batch({"a": torch.zeros(4), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="non-tensor 'uid' has leading dim 2"):
        Batch.from_dict({"a": torch.zeros(4)}, {"uid": ["x", "y"]})


def test_bad_column_types():
    with pytest.raises(TypeError, match="tensor 'a' must be a torch.Tensor, got list"):
        Batch({"a": [1, 2]})
    with pytest.raises(TypeError, match="non-tensor 'u' must be a numpy.ndarray"):
        Batch(non_tensors={"u": ["x"]})
    with pytest.raises(ValueError, match="'a' is 0-d"):
        Batch({"a": torch.tensor(1.0)})
    with pytest.raises(ValueError, match=r"\['x'\] are both tensor and non-tensor"):
        Batch({"x": torch.zeros(2)}, {"x": np.zeros(2)})


def test_from_dict_nested_lists_stay_1d():
    b = Batch.from_dict(non_tensors={"msgs": [[1, 2], [3, 4]]})
    assert b.non_tensors["msgs"].shape == (2,) and b.non_tensors["msgs"][1] == [3, 4]
    assert len(b) == 2 and len(Batch()) == 0


# ----------------------------------------------------------------- indexing
def test_indexing_forms():
    b = make()
    assert len(b[2]) == 1 and b[2].tensors["ids"][0].tolist() == [6, 7, 8]
    assert b[-1].non_tensors["uid"][0] == "u5"
    assert b[1:3].non_tensors["uid"].tolist() == ["u1", "u2"]
    assert b[[4, 0]].non_tensors["uid"].tolist() == ["u4", "u0"]
    assert b[np.array([5])].tensors["ids"].tolist() == [[15, 16, 17]]
    assert b[torch.tensor([1, 1])].non_tensors["uid"].tolist() == ["u1", "u1"]
    masked = b[b.tensors["mask"]]
    assert masked.non_tensors["uid"].tolist() == ["u0", "u2", "u4"]
    assert b[np.array([True] + [False] * 5)].non_tensors["uid"].tolist() == ["u0"]
    assert len(b[[]]) == 0 and b[[]].tensors["ids"].shape == (0, 3)
    assert b[0].meta == {"step": 1}
    assert b["uid"] is b.non_tensors["uid"] and "ids" in b and "nope" not in b


def test_indexing_errors():
    b = make()
    with pytest.raises(IndexError, match="index 6 out of range for length 6"):
        b[6]
    with pytest.raises(IndexError, match="bool mask has length 2, batch has 6"):
        b[[True, False]]
    with pytest.raises(TypeError, match="int or bool"):
        b[np.array([0.5])]
    with pytest.raises(KeyError, match="no key 'nope'"):
        b["nope"]


# ------------------------------------------------------------- key subsets
def test_select_and_pop():
    b = make()
    s = b.select(["ids"], ["uid"])
    assert s.keys() == ["ids", "uid"] and b.keys() == make().keys()
    assert b.select(non_tensor_keys=[]).keys() == ["ids", "mask", "logp"]
    with pytest.raises(KeyError, match=r"no tensor key\(s\) \['nope'\]"):
        b.select(["nope"])
    p = b.pop(["mask"], ["extra"])
    assert p.keys() == ["mask", "extra"] and b.keys() == ["ids", "logp", "uid"]
    assert b.pop().keys() == []  # None pops nothing, as in verl
    with pytest.raises(KeyError):
        b.pop(["ids"], ["missing"])
    assert "ids" in b  # failed pop left the batch untouched


def test_union():
    b = make()
    left, right = b.select(["ids"], []), b.select(["ids", "mask"], ["uid"])
    u = left.union(right)
    assert u.keys() == ["ids", "mask", "uid"] and "mask" not in left
    conflict = Batch({"ids": b.tensors["ids"] + 1})
    with pytest.raises(ValueError, match="tensor key 'ids' differs"):
        left.union(conflict)
    with pytest.raises(ValueError, match="non-tensor key 'uid' differs"):
        b.union(Batch.from_dict(non_tensors={"uid": ["z"] * 6}))
    with pytest.raises(ValueError, match="meta key 'step' differs"):
        b.union(Batch(meta={"step": 2}))
    with pytest.raises(ValueError, match="of length 6 and 2"):
        b.union(Batch({"x": torch.zeros(2)}))
    nan = Batch({"v": torch.tensor([float("nan"), 1.0])})
    assert nan.union(Batch({"v": torch.tensor([float("nan"), 1.0])})).keys() == ["v"]


# ----------------------------------------------------------- row operations
def test_split_chunk_concat_round_trip():
    b = make(7)
    parts = b.split(3)
    assert [len(p) for p in parts] == [3, 3, 1]
    assert_batch_equal(Batch.concat(parts), b)
    with pytest.raises(ValueError, match="cannot chunk a Batch of length 7 into 2 equal parts; "
                                         r"use pad_to_divisor\(2\) first"):
        b.chunk(2)
    chunks = make(6).chunk(3)
    assert [len(c) for c in chunks] == [2, 2, 2]
    assert_batch_equal(Batch.concat(chunks), make(6))


def test_concat_meta_and_key_errors():
    a, b = make(2, meta={"m": "a"}), make(3, meta={"m": "b"})
    assert Batch.concat([a, b]).meta == {"m": "a"} and len(Batch.concat([a, b])) == 5
    with pytest.raises(ValueError, match="batch 1 has keys"):
        Batch.concat([a, b.select(["ids"])])
    with pytest.raises(ValueError, match="tensor 'x'"):
        Batch.concat([Batch({"x": torch.zeros(2, 3)}), Batch({"x": torch.zeros(2, 4)})])
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])


def test_repeat_interleave_vs_tile():
    b = Batch.from_dict({"x": torch.tensor([[1, 1], [2, 2]])}, {"u": ["a", "b"]})
    inter = b.repeat(2)
    assert inter.tensors["x"][:, 0].tolist() == [1, 1, 2, 2]
    assert inter.non_tensors["u"].tolist() == ["a", "a", "b", "b"]
    tiled = b.repeat(3, interleave=False)
    assert tiled.tensors["x"].shape == (6, 2)
    assert tiled.tensors["x"][:, 1].tolist() == [1, 2, 1, 2, 1, 2]
    assert tiled.non_tensors["u"].tolist() == ["a", "b"] * 3


def test_pad_unpad():
    b = make(5)
    padded, pad = b.pad_to_divisor(4)
    assert pad == 3 and len(padded) == 8
    assert padded.non_tensors["uid"].tolist()[5:] == ["u0", "u1", "u2"]
    assert_batch_equal(padded.unpad(pad), b)
    same, zero = b.pad_to_divisor(5)
    assert zero == 0 and same is b
    tiny, pad = make(2).pad_to_divisor(7)  # pad larger than the batch cycles
    assert pad == 5 and tiny.non_tensors["uid"].tolist() == ["u0", "u1"] * 3 + ["u0"]
    with pytest.raises(ValueError, match="pad_size 9 out of range"):
        b.unpad(9)


def test_to_device_keeps_columns():
    b = make().to("cpu")
    assert b.tensors["logp"].dtype == torch.bfloat16 and b.keys() == make().keys()


# ----------------------------------------------------------------- pickling
def test_pickle_round_trip_dtypes():
    b = make()
    b.tensors["f32"] = torch.randn(6, 2)
    b.tensors["i64"] = torch.tensor([2**40 + i for i in range(6)])
    b.tensors["f16"] = torch.randn(6).half()
    b.non_tensors["score"] = np.arange(6, dtype=np.float64)
    out = pickle.loads(pickle.dumps(b))
    assert_batch_equal(out, b)
    assert out.tensors["mask"].dtype == torch.bool
    assert out.tensors["logp"].dtype == torch.bfloat16
    assert out.non_tensors["extra"][3] == {"i": 3}


def test_pickle_travels_as_numpy():
    state = make().__getstate__()
    kinds = {k: v[0] for k, v in state["tensors"].items()}
    assert kinds == {"ids": "np", "mask": "np", "logp": "view"}
    assert all(isinstance(v[1], np.ndarray) for v in state["tensors"].values())


def test_pickle_slice_sends_only_rows():
    big = Batch({"x": torch.zeros(10_000, 100)})
    assert len(pickle.dumps(big[:2])) < 10_000


@pytest.mark.filterwarnings("error")  # torch warns when aliasing read-only numpy
def test_unpickled_tensors_writable_when_arrays_read_only():
    # Simulate Ray's zero-copy object store, which hands back read-only arrays.
    state = make().__getstate__()
    for _, arr, _ in state["tensors"].values():
        arr.flags.writeable = False
    state["non_tensors"]["score"] = np.arange(6.0)
    state["non_tensors"]["score"].flags.writeable = False
    b = Batch.__new__(Batch)
    b.__setstate__(state)
    b.tensors["ids"][0, 0] = 100  # would fault/warn if aliasing read-only memory
    b.tensors["logp"][0] = 2.0
    b.non_tensors["score"][0] = 5.0
    assert b.tensors["logp"][0].item() == 2.0


@pytest.mark.filterwarnings("error")
def test_pickle_protocol5_read_only_buffers():
    # What Ray does: numeric arrays go out-of-band and come back over read-only memory.
    b = make()
    buffers = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    assert buffers, "numeric columns should travel out-of-band"
    out = pickle.loads(data, buffers=[memoryview(bytes(pb.raw())) for pb in buffers])
    assert_batch_equal(out, b)
    out.tensors["ids"] += 1
    assert torch.equal(out.tensors["ids"], b.tensors["ids"] + 1)


def test_pickle_version_mismatch():
    state = make().__getstate__()
    state["v"] = 999
    with pytest.raises(ValueError, match="format 999"):
        Batch.__new__(Batch).__setstate__(state)

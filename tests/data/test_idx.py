"""IDX reading/writing, the offline loaders and Zhang, Zhu, Fay & Johansson's ("Locally
Differentially Private Online Federated Learning With Correlated Noise") non-IID split."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from experiments.data.mnist import FASHION_MNIST_DEBIAN, load_dataset, paper_partition
from flwr_corrnoise.data.idx import (
    FILES,
    load_idx_dir,
    read_idx,
    write_idx,
)


def make_idx_dir(directory: Path, n_train: int = 50, n_test: int = 20, gz: bool = True,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A tiny MNIST-shaped dataset of our own, in the four standard files."""
    g = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    tx = g.integers(0, 256, size=(n_train, 28, 28), dtype=np.uint8)
    ty = (np.arange(n_train) % 10).astype(np.uint8)
    ex = g.integers(0, 256, size=(n_test, 28, 28), dtype=np.uint8)
    ey = (np.arange(n_test) % 10).astype(np.uint8)
    suffix = ".gz" if gz else ""
    for key, arr in (("train_x", tx), ("train_y", ty), ("test_x", ex), ("test_y", ey)):
        write_idx(directory / (FILES[key] + suffix), arr)
    return tx, ty


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32,
                                   np.float64])
@pytest.mark.parametrize("name", ["a.idx", "a.idx.gz"])
def test_round_trip(tmp_path: Path, dtype, name: str) -> None:
    arr = (np.arange(2 * 3 * 4) - 7).astype(dtype).reshape(2, 3, 4)
    if np.dtype(dtype).kind == "u":
        arr = np.abs(arr.astype(np.int64)).astype(dtype)
    write_idx(tmp_path / name, arr)
    back = read_idx(tmp_path / name)
    assert back.dtype == np.dtype(dtype) and back.shape == (2, 3, 4)
    np.testing.assert_array_equal(back, arr)
    raw = (tmp_path / name).read_bytes()
    raw = gzip.decompress(raw) if name.endswith(".gz") else raw
    assert raw[:3] == b"\0\0" + bytes([read_code(dtype)])


def read_code(dtype) -> int:
    return {np.uint8: 8, np.int8: 9, np.int16: 11, np.int32: 12, np.float32: 13,
            np.float64: 14}[dtype]


def test_known_bytes_are_parsed_big_endian(tmp_path: Path) -> None:
    raw = b"\0\0\x0b\x02" + (2).to_bytes(4, "big") + (1).to_bytes(4, "big") + b"\x01\x02\xff\xfe"
    (tmp_path / "x").write_bytes(raw)
    np.testing.assert_array_equal(read_idx(tmp_path / "x"), [[258], [-2]])


@pytest.mark.parametrize("damage,match", [
    (lambda b: b"\x01" + b[1:], "bad magic"),
    (lambda b: b[:-1], "truncated IDX data"),
    (lambda b: b + b"\0", "trailing bytes"),
    (lambda b: b[:6], "truncated IDX header"),
])
def test_corrupt_files_are_refused(tmp_path: Path, damage, match: str) -> None:
    write_idx(tmp_path / "x", np.zeros((3, 2), dtype=np.uint8))
    (tmp_path / "x").write_bytes(damage((tmp_path / "x").read_bytes()))
    with pytest.raises(ValueError, match=match):
        read_idx(tmp_path / "x")


@pytest.mark.parametrize("gz", [True, False])
def test_load_idx_dir(tmp_path: Path, gz: bool) -> None:
    tx, ty = make_idx_dir(tmp_path / "d", gz=gz)
    ds = load_idx_dir(tmp_path / "d", "mnist")
    assert ds.train_x.shape == (50, 1, 28, 28) and ds.train_x.dtype == np.float32
    assert ds.test_x.shape == (20, 1, 28, 28) and ds.num_classes == 10
    np.testing.assert_allclose(ds.train_x[:, 0] * 255.0, tx, atol=1e-4)
    np.testing.assert_array_equal(ds.train_y, ty)
    assert ds.name == "mnist" and ds.source == str(tmp_path / "d")
    assert load_dataset("mnist", root=tmp_path / "d").train_x.shape == ds.train_x.shape


def test_load_idx_dir_refuses_mismatch_and_missing(tmp_path: Path) -> None:
    make_idx_dir(tmp_path / "d")
    write_idx(tmp_path / "d" / (FILES["train_y"] + ".gz"), np.zeros(49, dtype=np.uint8))
    with pytest.raises(ValueError, match="do not match"):
        load_idx_dir(tmp_path / "d", "mnist")
    (tmp_path / "d" / (FILES["test_x"] + ".gz")).unlink()
    with pytest.raises(FileNotFoundError, match="t10k-images"):
        load_idx_dir(tmp_path / "d", "mnist")


def test_offline_without_files_says_how(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("experiments.data.mnist.CACHE", tmp_path)
    with pytest.raises(RuntimeError, match="not available offline"):
        load_dataset("mnist")
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("cifar")


def test_paper_partition() -> None:
    labels = np.repeat(np.arange(10), 100)  # 1000 images, 100 per class
    parts = paper_partition(labels, num_learners=10, iid_size=500, seed=3)
    allidx = np.concatenate(parts)
    assert sorted(allidx.tolist()) == list(range(1000))  # a partition
    # the iid part is spread evenly: with everything iid each learner gets n/10 ...
    assert [len(p) for p in paper_partition(labels, 10, iid_size=1000)] == [100] * 10
    # ... with nothing iid, learner l gets exactly class l ...
    for i, p in enumerate(paper_partition(labels, 10, iid_size=0)):
        assert sorted(p.tolist()) == np.flatnonzero(labels == i).tolist()
    # ... and in between, a learner's images of other classes all come from its 50 iid ones
    for i, p in enumerate(parts):
        assert 0 < np.sum(labels[p] != i) <= 50
    assert sum(len(p) for p in parts) == 1000
    # deterministic in the seed, different across seeds
    again = paper_partition(labels, num_learners=10, iid_size=500, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = paper_partition(labels, num_learners=10, iid_size=500, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))
    with pytest.raises(ValueError, match="iid_size"):
        paper_partition(labels, iid_size=1001)


@pytest.mark.skipif(not Path(FASHION_MNIST_DEBIAN).is_dir(),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_debian_fashion_mnist() -> None:
    ds = load_dataset("fashion-mnist")
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert ds.num_classes == 10 and ds.source == FASHION_MNIST_DEBIAN
    assert np.bincount(ds.test_y).tolist() == [1000] * 10


def test_gzip_is_detected_by_magic_not_name(tmp_path: Path) -> None:
    arr = np.arange(12, dtype=np.uint8).reshape(3, 4)
    write_idx(tmp_path / "a.gz", arr)
    (tmp_path / "a.gz").rename(tmp_path / "plain-name")
    assert gzip.decompress((tmp_path / "plain-name").read_bytes())[:2] == b"\0\0"
    np.testing.assert_array_equal(read_idx(tmp_path / "plain-name"), arr)


def test_error_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "junk").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="junk"):
        read_idx(tmp_path / "junk")


def test_labels_outside_0_9_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    write_idx(d / FILES["train_x"], np.zeros((5, 28, 28), np.uint8))
    write_idx(d / FILES["train_y"], np.array([0, 1, 2, 3, 10], np.uint8))
    write_idx(d / FILES["test_x"], np.zeros((2, 28, 28), np.uint8))
    write_idx(d / FILES["test_y"], np.array([0, 1], np.uint8))
    with pytest.raises(ValueError, match=r"outside 0\.\.9"):
        load_idx_dir(d, "mnist")


def test_partition_balance_and_label_routing_with_learners_beyond_classes() -> None:
    # 3 classes, 5 learners: learners 3 and 4 get only iid images, so their sizes show the
    # iid spread (iid_size / 5, ±1); every other image of class l is on learner l.
    labels = np.repeat(np.arange(3), [40, 30, 33])
    iid_size = 52
    parts = paper_partition(labels, num_learners=5, iid_size=iid_size, seed=1)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(labels)))
    for j in (3, 4):
        assert len(parts[j]) in (iid_size // 5, -(-iid_size // 5))
    non_iid = len(labels) - iid_size
    own = sum(int(np.sum(labels[parts[j]] == j)) for j in range(3))
    foreign = sum(int(np.sum(labels[parts[j]] != j)) for j in range(5))
    assert own >= non_iid and foreign <= iid_size and own + foreign == len(labels)
    # class l -> learner l % num_learners: with 2 learners, class 2 joins learner 0
    two = paper_partition(labels, num_learners=2, iid_size=0)
    assert sorted(two[0].tolist()) == np.flatnonzero(labels % 2 == 0).tolist()

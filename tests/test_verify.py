"""Verification of prepared shards: hashed once, trusted on reruns only while the file is provably the
same, and still hashed when no stamp can be written."""
from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time

import pytest

from ddpmrepro.data import DataError, load_prepared, prepare
from ddpmrepro.data.verify import Verifier
from ddpmrepro.params import DataParams


@pytest.fixture
def data(tmp_path):
    out = tmp_path / "p"
    prepare(DataParams(image_size=12, channels=3), out)
    return out


def shard_bytes(d) -> int:
    return sum(f.stat().st_size for f in d.glob("*.npy"))


def test_a_rerun_reads_nothing_and_an_in_place_change_is_caught_even_with_mtime_restored(data, tmp_path):
    v = Verifier(tmp_path / "stamps")
    load_prepared(data, verifier=v)
    assert v.hashed_bytes == shard_bytes(data)  # the first load hashes every shard
    load_prepared(data, verifier=v)
    assert v.hashed_bytes == shard_bytes(data)  # the rerun trusts the stamps
    # Same size, same mtime (put back as `touch -d` would): only ctime tells, and it is enough.
    time.sleep(0.05)  # ctime ticks with the kernel's coarse clock (a few ms): step past the stamp's tick
    target = data / "train-00000.images.npy"
    st = target.stat()
    with open(target, "r+b") as f:
        f.seek(st.st_size - 5)
        f.write(bytes([f.read(1)[0] ^ 1]))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert target.stat().st_mtime_ns == st.st_mtime_ns and target.stat().st_size == st.st_size
    with pytest.raises(DataError, match=r"train-00000\.images\.npy: sha256 does not match manifest\.json"):
        load_prepared(data, verifier=v)


def test_a_replaced_file_is_hashed_again(data, tmp_path):
    v = Verifier(tmp_path / "stamps")
    load_prepared(data, verifier=v)
    first = v.hashed_bytes
    target = data / "test-00000.images.npy"
    shutil.copy2(target, tmp_path / "copy")
    os.replace(tmp_path / "copy", target)  # same bytes and mtime, new inode (a copy, `dvc checkout`)
    load_prepared(data, verifier=v)
    assert v.hashed_bytes == first + target.stat().st_size


def test_without_a_writable_stamp_directory_everything_is_hashed_every_time(data, tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    v = Verifier(blocker / "stamps")
    assert "every start will hash" in caplog.text
    load_prepared(data, verifier=v)
    load_prepared(data, verifier=v)
    assert v.hashed_bytes == 2 * shard_bytes(data)


def test_concurrent_verifiers_hash_each_file_once(data, tmp_path):
    """The ranks of a node start together: one hashes a file while the others wait for its stamp."""
    verifiers = [Verifier(tmp_path / "stamps", threads=1) for _ in range(4)]
    expected = {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(data.glob("*.npy"))}
    threads = [threading.Thread(target=v.verify, args=(expected,)) for v in verifiers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(v.hashed_bytes for v in verifiers) == shard_bytes(data)
    assert Verifier(tmp_path / "stamps").verify({**expected, next(iter(expected)): "0" * 64}) == [next(iter(expected))]

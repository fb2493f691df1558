"""Parts are checked against a XXH3 digest, once per process for a file that has not changed:
the cache is keyed by the file's stat identity and refuses hashes taken in the same timestamp
tick as the file's last change. Manifests written with sha256 before still verify."""

import hashlib
import os

import pytest
import xxhash

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store import rundir
from flowgrpo_cli.store.rundir import StageWriter, verify_stage, xxh3_file

OLD_NS = 10**9 * 1_000_000_000  # 2001-09-09: far more than _RACY_NS before any test runs


@pytest.fixture
def hashes(monkeypatch):
    """Counts the files hashed, by name."""
    calls: list[str] = []

    def counting(path):
        calls.append(path.name)
        return xxh3_file(path)

    monkeypatch.setitem(rundir.PART_DIGESTS, "xxh3_128", counting)
    monkeypatch.setattr(rundir, "xxh3_file", counting)
    monkeypatch.setattr(rundir, "_verified", {})
    return calls


def finished_stage(folder, content=b"0123456789" * 1000, mtime_ns=OLD_NS):
    folder.mkdir()
    part = folder / "part-0.bin"
    part.write_bytes(content)
    os.utime(part, ns=(mtime_ns, mtime_ns))
    StageWriter(folder, "test", {}).finish([part.name], counts={})
    return part


def test_xxh3_file_matches_the_reference_digest(tmp_path):
    for size in (0, 1, 1 << 20, (1 << 20) + 7):
        path = tmp_path / f"f{size}"
        data = os.urandom(size)
        path.write_bytes(data)
        assert xxh3_file(path) == xxhash.xxh3_128(data).hexdigest()


def test_a_manifest_records_size_and_xxh3(tmp_path):
    part = finished_stage(tmp_path / "s", content=b"abc")
    entry = rundir.read_manifest(tmp_path / "s")["parts"][0]
    assert entry == {"name": part.name, "bytes": 3, "xxh3_128": xxhash.xxh3_128(b"abc").hexdigest()}


def test_an_unchanged_part_is_hashed_once_per_process(tmp_path, hashes, monkeypatch):
    # the stat identity is taken while the clock is far past the file's ctime
    ctime = tmp_path.stat().st_ctime_ns
    monkeypatch.setattr(rundir.time, "time_ns", lambda: ctime + 10 * rundir._RACY_NS)
    finished_stage(tmp_path / "s")
    for _ in range(3):
        verify_stage(tmp_path / "s")
    assert hashes == ["part-0.bin"]  # the writer's hash served all three reads


def test_a_part_changed_after_it_was_hashed_is_hashed_again_and_caught(
    tmp_path, hashes, monkeypatch
):
    ctime = tmp_path.stat().st_ctime_ns
    monkeypatch.setattr(rundir.time, "time_ns", lambda: ctime + 10 * rundir._RACY_NS)
    part = finished_stage(tmp_path / "s")
    verify_stage(tmp_path / "s")
    data = bytearray(part.read_bytes())
    data[5] ^= 0xFF
    part.write_bytes(bytes(data))
    os.utime(part, ns=(OLD_NS, OLD_NS))  # same size, same mtime: only ctime tells
    with pytest.raises(FlowGrpoError, match="checksum differs from the manifest"):
        verify_stage(tmp_path / "s")
    assert hashes == ["part-0.bin", "part-0.bin"]


def test_a_hash_taken_in_the_tick_of_the_last_change_is_not_trusted(tmp_path, hashes):
    # written just now: the file's ctime is within _RACY_NS of the clock, so every read hashes
    finished_stage(tmp_path / "s")
    verify_stage(tmp_path / "s")
    verify_stage(tmp_path / "s")
    assert hashes == ["part-0.bin"] * 3


def test_a_manifest_written_with_sha256_still_verifies(tmp_path):
    part = finished_stage(tmp_path / "s", content=b"old run")
    manifest = rundir.read_manifest(tmp_path / "s")
    manifest["parts"] = [
        {"name": part.name, "bytes": 7, "sha256": hashlib.sha256(b"old run").hexdigest()}
    ]
    rundir.atomic_write_json(tmp_path / "s" / rundir.MANIFEST, manifest)
    verify_stage(tmp_path / "s")
    part.write_bytes(b"new run")
    with pytest.raises(FlowGrpoError, match="checksum differs from the manifest"):
        verify_stage(tmp_path / "s")


def test_a_part_entry_without_a_digest_is_refused(tmp_path):
    part = finished_stage(tmp_path / "s")
    manifest = rundir.read_manifest(tmp_path / "s")
    manifest["parts"] = [{"name": part.name, "bytes": part.stat().st_size}]
    rundir.atomic_write_json(tmp_path / "s" / rundir.MANIFEST, manifest)
    with pytest.raises(FlowGrpoError, match=r"`parts\[0\]` records no digest"):
        verify_stage(tmp_path / "s")

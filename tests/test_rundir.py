"""Run directory: atomic parts, manifests with checksums, and the single-writer lock."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from socket import gethostname

import pytest

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.rundir import (
    ROLLOUT,
    RunDir,
    RunLock,
    StageWriter,
    atomic_file,
    atomic_write_bytes,
    part_name,
    read_manifest,
    verify_stage,
)

IDENTITY = {"config": "abc", "inputs": {}}


def write_stage(stage_dir, parts, identity=IDENTITY):
    writer = StageWriter(stage_dir, "rollout", identity)
    assert writer.begin()
    for name, data in parts.items():
        atomic_write_bytes(writer.part_path(name), data)
    return writer.finish(list(parts), {"rows": len(parts)})


def test_layout_names():
    run = RunDir(Path("runs/x"))
    assert run.stage_dir(7, ROLLOUT).as_posix() == "runs/x/iter-000007/rollout"
    assert run.checkpoint_dir(7).as_posix() == "runs/x/checkpoints/iter-000007"
    assert run.samples_path(7).as_posix() == "runs/x/samples/iter-000007.png"
    assert part_name(0, 4) == "part-00000-of-00004.arrow"


def test_atomic_file_leaves_nothing_on_error(tmp_path):
    target = tmp_path / "part.bin"
    with pytest.raises(RuntimeError), atomic_file(target) as handle:
        handle.write(b"half")
        raise RuntimeError("writer failed")
    assert list(tmp_path.iterdir()) == []


def test_writer_killed_mid_part_leaves_no_visible_part_and_rerun_completes(tmp_path):
    stage_dir = tmp_path / "rollout"
    writer = StageWriter(stage_dir, "rollout", IDENTITY)
    writer.begin()
    atomic_write_bytes(writer.part_path("part-00000-of-00002.arrow"), b"first part")
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from flowgrpo_cli.store.rundir import atomic_file
        with atomic_file(Path({str(stage_dir / "part-00001-of-00002.arrow")!r})) as handle:
            handle.write(b"x" * 1000)
            handle.flush()
            print("writing", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"writing\n"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    visible = sorted(p.name for p in stage_dir.iterdir() if ".tmp-" not in p.name)
    assert visible == ["part-00000-of-00002.arrow", "pending.json"]
    assert read_manifest(stage_dir) is None  # incomplete

    rerun = StageWriter(stage_dir, "rollout", IDENTITY)
    assert rerun.begin()
    assert rerun.has_part("part-00000-of-00002.arrow")  # finished part kept
    assert not rerun.has_part("part-00001-of-00002.arrow")
    assert not any(".tmp-" in p.name for p in stage_dir.iterdir())  # debris removed
    atomic_write_bytes(rerun.part_path("part-00001-of-00002.arrow"), b"second part")
    manifest = rerun.finish(["part-00000-of-00002.arrow", "part-00001-of-00002.arrow"], {})
    assert [p["bytes"] for p in manifest["parts"]] == [10, 11]
    assert not (stage_dir / "pending.json").exists()
    assert not StageWriter(stage_dir, "rollout", IDENTITY).begin()  # complete now


def test_rerun_with_other_identity_discards_old_parts(tmp_path):
    stage_dir = tmp_path / "score"
    first = StageWriter(stage_dir, "score", IDENTITY)
    first.begin()
    atomic_write_bytes(first.part_path("part-00000-of-00001.arrow"), b"old")
    second = StageWriter(stage_dir, "score", {"config": "other", "inputs": {}})
    second.begin()
    assert not second.has_part("part-00000-of-00001.arrow")


def test_finished_stage_with_other_identity_is_refused(tmp_path):
    write_stage(tmp_path / "s", {"a.arrow": b"1"})
    with pytest.raises(FlowGrpoError, match="another config"):
        StageWriter(tmp_path / "s", "rollout", {"config": "new", "inputs": {}}).begin()


def test_verify_detects_truncated_and_altered_parts(tmp_path):
    stage_dir = tmp_path / "s"
    write_stage(stage_dir, {"a.arrow": b"0123456789", "b.arrow": b"abcdefghij"})
    assert verify_stage(stage_dir)["counts"] == {"rows": 2}
    (stage_dir / "a.arrow").write_bytes(b"01234")
    with pytest.raises(FlowGrpoError, match=r"a\.arrow: 5 bytes, the manifest says 10"):
        verify_stage(stage_dir)
    (stage_dir / "a.arrow").write_bytes(b"0123456789")
    (stage_dir / "b.arrow").write_bytes(b"abcdefghiX")
    with pytest.raises(FlowGrpoError, match=r"b\.arrow: checksum differs"):
        verify_stage(stage_dir)
    (stage_dir / "b.arrow").unlink()
    with pytest.raises(FlowGrpoError, match="missing"):
        verify_stage(stage_dir)


def test_manifest_is_written_last(tmp_path):
    stage_dir = tmp_path / "s"
    writer = StageWriter(stage_dir, "rollout", IDENTITY)
    writer.begin()
    with pytest.raises(FlowGrpoError, match="part missing"):
        writer.finish(["never-written.arrow"], {})
    assert read_manifest(stage_dir) is None


def hold_lock(run_root):
    """A process that holds `run_root`'s lock until killed (the caller kills it)."""
    code = (
        "import time\n"
        "from pathlib import Path\n"
        "from flowgrpo_cli.store.rundir import RunLock\n"
        f"lock = RunLock(Path({str(run_root)!r})).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_lock_refuses_a_live_holder_and_names_its_pid(tmp_path):
    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(FlowGrpoError, match=f"locked by pid {holder.pid};"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path):  # a killed holder's lock ends with it: nothing stale is left
        owner = json.loads((tmp_path / "run.lock").read_text())
        assert owner == {"pid": os.getpid(), "host": gethostname()}
    assert (tmp_path / "run.lock").read_text() == ""  # released: the file stays, empty


def test_a_lock_file_nobody_holds_is_taken_whatever_it_says(tmp_path):
    for text in ('{"pid": 1, "host": "elsewhere"}', "abc", '{"host": "x"}', ""):
        (tmp_path / "run.lock").write_text(text)
        with RunLock(tmp_path):
            assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()


def test_taking_the_lock_removes_temp_files_of_killed_writers_only(tmp_path):
    run = RunDir(tmp_path)
    left = [  # what a writer killed inside atomic_file leaves
        run.checkpoint_dir(3) / "optimizer.safetensors.tmp-4242",
        run.checkpoint_dir(3) / "ema" / "pytorch_lora_weights.safetensors.tmp-4242",
        tmp_path / "metrics.jsonl.tmp-17",
        run.samples_path(2).with_name("iter-000002.png.tmp-17"),
    ]
    kept = [tmp_path / "notes.tmp-draft", run.checkpoint_dir(3) / "optimizer.safetensors"]
    for path in left + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    with RunLock(tmp_path):
        assert [p.exists() for p in left + kept] == [False] * len(left) + [True] * len(kept)


def test_second_lock_in_same_process_is_refused(tmp_path):
    with RunLock(tmp_path), pytest.raises(FlowGrpoError, match="locked by pid"):
        RunLock(tmp_path).acquire()


def _contend(run_root, barrier, holders, most, wins, trials):
    for _ in range(trials):
        barrier.wait()
        try:
            lock = RunLock(run_root).acquire()
        except FlowGrpoError:
            lock = None
        if lock is not None:
            with holders.get_lock():
                holders.value += 1
                most.value = max(most.value, holders.value)
            time.sleep(0.001)
            with holders.get_lock():
                holders.value -= 1
            lock.release()
            with wins.get_lock():
                wins.value += 1
        barrier.wait()


def test_processes_racing_for_the_lock_never_hold_it_together(tmp_path):
    import multiprocessing

    context = multiprocessing.get_context("fork")
    trials, racers = 100, 3
    barrier = context.Barrier(racers)
    holders, most, wins = context.Value("i", 0), context.Value("i", 0), context.Value("i", 0)
    processes = [
        context.Process(target=_contend, args=(tmp_path, barrier, holders, most, wins, trials))
        for _ in range(racers)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    assert most.value == 1  # never two holders at once
    assert wins.value >= trials  # and every trial had one


def test_iterations_listed_in_order(tmp_path):
    run = RunDir(tmp_path)
    for n in (3, 1, 12):
        run.iteration_dir(n).mkdir()
    (tmp_path / "iter-notes").mkdir()
    assert run.iterations() == [1, 3, 12]

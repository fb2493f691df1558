"""5. Writing and reading a rollout part as Arrow, against a plain file of the same bytes.

The part has SD3.5's shapes at 512x512 with the paper's 10 steps: 16 rows in two record batches
of 8 (a rollout batch each), latents float32 [11, 16, 64, 64] per row (2.9 MB), a 300 kB
stand-in for the PNG, 10 log-probs and sigmas.

write A: `to_record_batch` per batch + `ArrowPartWriter` (what the rollout stage does: a
         temporary file, flush, fsync, rename).
write B: `shutil.copyfile` of a file of the same size (no fsync, no conversion).
read A:  `open_part` (memory-mapped), every record batch, the latents copied out with
         `tensor_column` (as the update's reader does) and summed.
read B:  the plain file read into memory and the same number of float32 bytes summed.

Two more write sides explain the gap: Arrow without fsync and rename (`pa.ipc.new_file` on an
open file), and the copy followed by an fsync.

5c. What checking a part against its manifest adds to reading it: the stages verify every input
part (`verify_stage`: size and XXH3 digest) before reading it. A: verify, then the Arrow read
of 5b, in a process that has not hashed the part before (the cache of verified files emptied
each round); B: the Arrow read alone. The note gives the same with the sha256 the manifests
recorded before, and the repeated check (the part already hashed by this process: a stat).
"""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import torch

from benchmarks.common import (
    Context,
    Report,
    Row,
    Side,
    alternate,
    fmt_mb,
    fmt_ratio,
    fmt_s,
    remove,
)

ROWS, BATCH, STEPS = 16, 8, 10
LATENT = (16, 64, 64)  # SD3.5 at 512x512
PNG_BYTES = 300_000


def _rows(start: int, count: int):
    from flowgrpo_cli.store.trajectory import TrajectoryRows

    generator = torch.Generator().manual_seed(start)
    sigmas = torch.linspace(1.0, 0.0, STEPS + 1)
    return TrajectoryRows(
        sample_ids=[
            f"i000000-g{(start + i) // 8:04d}-k{(start + i) % 8:03d}" for i in range(count)
        ],
        prompt_indices=list(range(start, start + count)),
        group_ids=[(start + i) // 8 for i in range(count)],
        seeds=list(range(start, start + count)),
        prompts=['A sign that reads "OPEN" in red neon.'] * count,
        ground_truths=["OPEN"] * count,
        timesteps=sigmas[:-1].expand(count, STEPS).clone(),
        timesteps_next=sigmas[1:].expand(count, STEPS).clone(),
        trained=torch.ones(count, STEPS, dtype=torch.bool),
        log_probs=torch.randn(count, STEPS, generator=generator),
        latents=torch.randn(count, STEPS + 1, *LATENT, generator=generator),
        images=[os.urandom(PNG_BYTES) for _ in range(count)],
    )


def run(ctx: Context, report: Report, shared: dict) -> None:
    import pyarrow as pa

    from flowgrpo_cli.store.trajectory import (
        ArrowPartWriter,
        open_part,
        tensor_column,
        to_record_batch,
    )

    folder = ctx.workdir / "arrow"
    folder.mkdir(parents=True, exist_ok=True)
    batches = [_rows(start, BATCH) for start in range(0, ROWS, BATCH)]
    part = folder / "part-00000-of-00001.arrow"
    plain_part = folder / "no-fsync.arrow"
    source = folder / "source.bin"
    copy = folder / "copy.bin"

    def write_arrow() -> None:
        with ArrowPartWriter(part) as out:
            for rows in batches:
                out.write(to_record_batch(rows))

    def write_arrow_plain() -> None:
        with open(plain_part, "wb") as handle:
            writer = None
            for rows in batches:
                batch = to_record_batch(rows)
                writer = writer or pa.ipc.new_file(handle, batch.schema)
                writer.write_batch(batch)
            writer.close()

    def copy_file() -> None:
        shutil.copyfile(source, copy)

    def copy_fsync() -> None:
        shutil.copyfile(source, copy)
        with open(copy, "rb+") as handle:
            os.fsync(handle.fileno())

    write_arrow()
    size = part.stat().st_size
    with open(source, "wb") as handle:  # the same number of bytes, not an Arrow file
        handle.write(os.urandom(size))
    shutil.copyfile(source, copy)
    latent_bytes = ROWS * (STEPS + 1) * int(np.prod(LATENT)) * 4

    def read_arrow() -> None:
        total = 0.0
        reader = open_part(part)
        for index in range(reader.num_record_batches):
            latents = tensor_column(reader.get_batch(index).column("latents"))
            total += float(latents.sum())

    def read_plain() -> None:
        data = np.fromfile(copy, dtype=np.uint8)
        float(np.frombuffer(data, dtype=np.float32, count=latent_bytes // 4).sum())

    writes = alternate(
        {
            "arrow": Side(write_arrow, reset=lambda: remove(part)),
            "copy": Side(copy_file, reset=lambda: remove(copy)),
            "arrow, no fsync": Side(write_arrow_plain, reset=lambda: remove(plain_part)),
            "copy + fsync": Side(copy_fsync, reset=lambda: remove(copy)),
        },
        reps=ctx.rounds(6),
    )
    if not part.exists():
        write_arrow()
    if not copy.exists():
        copy_file()
    from flowgrpo_cli.store import rundir

    rundir.StageWriter(folder, "bench", {}).finish([part.name], counts={})
    time.sleep(rundir._RACY_NS / 1e9 + 0.1)  # so that a hash of the part may be remembered

    def verify_then_read_arrow() -> None:
        rundir._verified.clear()
        rundir.verify_stage(folder)
        read_arrow()

    def sha256_then_read_arrow() -> None:
        rundir.sha256_file(part)
        read_arrow()

    def verify_again_then_read_arrow() -> None:
        rundir.verify_stage(folder)
        read_arrow()

    reads = alternate(
        {
            "arrow": Side(read_arrow),
            "plain": Side(read_plain),
            "verify + arrow": Side(verify_then_read_arrow),
            "sha256 + arrow": Side(sha256_then_read_arrow),
            "verify again + arrow": Side(verify_again_then_read_arrow),
        },
        reps=ctx.rounds(6),
    )
    shape = f"{ROWS} rows, latents [{STEPS + 1}, {', '.join(map(str, LATENT))}] float32"
    report.rows.append(
        Row(
            "5a. write a rollout part: Arrow vs file copy",
            fmt_s(writes.median("arrow")),
            fmt_s(writes.median("copy")),
            writes.ratio_text("arrow", "copy"),
            "-",
            "-",
            f"{fmt_mb(size)} part ({shape} + 300 kB PNG each), 2 record batches. Arrow "
            f"without fsync/rename {fmt_s(writes.median('arrow, no fsync'))} "
            f"({fmt_ratio(writes.ratio('arrow, no fsync', 'copy'))} the copy); copy + fsync "
            f"{fmt_s(writes.median('copy + fsync'))} "
            f"({fmt_ratio(writes.ratio('copy + fsync', 'copy'))}); "
            f"{ctx.rounds(6)} rounds",
        )
    )
    report.rows.append(
        Row(
            "5b. read a rollout part: Arrow (mmap) vs plain read",
            fmt_s(reads.median("arrow")),
            fmt_s(reads.median("plain")),
            reads.ratio_text("arrow", "plain"),
            "-",
            "-",
            "both from the page cache: Arrow = open_part + every record batch + latents "
            "copied out (tensor_column) and summed; plain = the file read into memory and "
            f"the same {fmt_mb(latent_bytes)} of float32 summed; {ctx.rounds(6)} rounds",
        )
    )
    report.rows.append(
        Row(
            "5c. verify a rollout part against its manifest, then read it, vs the read alone",
            fmt_s(reads.median("verify + arrow")),
            fmt_s(reads.median("arrow")),
            reads.ratio_text("verify + arrow", "arrow"),
            "<= 1.30x",
            "yes" if reads.ratio("verify + arrow", "arrow") <= 1.30 else "no",
            f"the {fmt_mb(size)} part of 5b from the page cache: size check + XXH3 of the "
            "whole file (what score and update do to every input part, on rank 0, the first "
            "time a process reads it), then the Arrow read of 5b. With sha256 instead: "
            f"{reads.ratio_text('sha256 + arrow', 'arrow')}; checked again by the same process "
            f"(unchanged since, a stat): {reads.ratio_text('verify again + arrow', 'arrow')}; "
            f"{ctx.rounds(6)} rounds",
        )
    )

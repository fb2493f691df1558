"""6. OCR reward throughput on 512x512 rendered text, with 1 and 2 worker processes.

`benchmarks.ocr_images.ocr_throughput` renders the images, starts the workers and builds
their engines untimed, then times one `score` of all images. The two worker counts alternate
(1 2, 2 1, ...); A is 1 worker, B is 2, and the ratio B / A is the speed-up from the second
worker (at most 2x, and only on two otherwise idle cores).
"""

from __future__ import annotations

import statistics

from benchmarks.common import Context, Report, Row, fmt_ratio

IMAGES = 12
SMOKE_IMAGES = 2  # --smoke


def run(ctx: Context, report: Report, shared: dict) -> None:
    from benchmarks.ocr_images import ocr_throughput

    rounds = 1 if ctx.quick else 2
    images = SMOKE_IMAGES if ctx.smoke else IMAGES
    speeds: dict[int, list[float]] = {1: [], 2: []}
    for rep in range(rounds):
        for workers in (1, 2) if rep % 2 == 0 else (2, 1):
            speeds[workers].append(ocr_throughput(images, workers))
    one, two = statistics.median(speeds[1]), statistics.median(speeds[2])
    speedup = statistics.median(b / a for a, b in zip(speeds[1], speeds[2], strict=True))
    report.rows.append(
        Row(
            "6. OCR reward, 512x512: 1 worker (A) vs 2 workers (B)",
            f"{one:.1f} images/s",
            f"{two:.1f} images/s",
            f"{fmt_ratio(speedup)} (B/A)",
            "-",
            "-",
            f"{images} images of two rendered words, engines built before timing; "
            f"{rounds} round(s). The speed-up is bounded by the free cores of a shared "
            "2-core machine",
        )
    )

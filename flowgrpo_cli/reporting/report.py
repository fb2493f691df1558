"""`flowgrpo report RUN`: one self-contained HTML page (plots and grids inlined) plus PNG plots.

Everything comes from RUN/metrics.jsonl and RUN/samples/ (and whether RUN/data holds an editing
data set, whose grids it then explains), so a report can be made while a run is still going, or
long after, and never needs the model. The page stays a few MB however long
the run: it inlines JPEG thumbnails of at most MAX_GRIDS training and MAX_GRIDS evaluation
grids (the first, the last and evenly spaced between), each linking to its full-size PNG.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.reporting.render import describe_best
from flowgrpo_cli.store.datatable import has_source_images
from flowgrpo_cli.store.evaluations import METRIC, Best, best_of
from flowgrpo_cli.store.metrics_log import read_log
from flowgrpo_cli.store.rundir import RunDir, atomic_write_bytes, remove_temp_files


@dataclass(frozen=True)
class Plot:
    name: str  # file stem
    title: str
    keys: list[str]  # metric keys drawn as lines, in legend order


def _plots(keys: set[str]) -> list[Plot]:
    rewards = sorted(k for k in keys if k.startswith("reward/") and k.endswith("_mean"))
    evals = sorted(k for k in keys if k.startswith("eval/") and k.endswith(("_mean", "_exact")))
    spreads = sorted(k for k in keys if k.startswith("reward/") and k.endswith("_std"))
    # each reward's own advantages: algorithm.reward_aggregation = "normalize_each" only
    own = sorted(k for k in keys if k.startswith("advantage/") and k.endswith("_std"))
    plots = [
        Plot("rewards", "reward (train: rollout mean, eval: held-out ODE samples)",
             ["reward/mean", *rewards, *evals]),
        Plot("reward_std", "reward std over each iteration's rollout images",
             ["reward/std", *spreads]),
        Plot("advantages", "advantage std, and each reward's own before weighting",
             ["advantage/std", *own]),
        Plot("loss", "loss", ["update/loss", "update/pg_loss"]),
        Plot("kl", "KL to the reference",
             ["update/kl_reference", "update/kl_gaussian", "update/approx_kl"]),
        Plot("clipfrac", "clipped share of ratios",
             ["update/clipfrac", "update/clipfrac_above", "update/clipfrac_below"]),
        Plot("ratio", "policy ratio and on-policy log-prob gap",
             ["update/ratio_mean", "update/ratio_min", "update/ratio_max",
              "update/logprob_gap_max"]),
        Plot("timings", "seconds per stage",
             ["rollout/seconds", "score/seconds", "update/seconds", "eval/seconds"]),
    ]  # fmt: skip
    return [p for p in plots if any(k in keys for k in p.keys)]


def _draw(plot: Plot, log: list[dict[str, Any]]) -> bytes:

    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for key in plot.keys:
        points = [(line["iteration"], line[key]) for line in log if key in line]
        if points:
            xs, ys = zip(*points, strict=True)
            axes.plot(xs, ys, marker="o", markersize=3, label=key)
    axes.set_title(plot.title, fontsize=10)
    axes.set_xlabel("iteration")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


MAX_GRIDS = 8  # per kind (training, evaluation)
THUMBNAIL_WIDTH = 512  # px


def _img(data: bytes, alt: str, mime: str = "image/png") -> str:
    encoded = base64.b64encode(data).decode()
    return f'<img alt="{html.escape(alt)}" src="data:{mime};base64,{encoded}">'


def _spread(items: list[Path], count: int) -> list[Path]:
    """`count` items: the first, the last and evenly spaced between (all when fewer)."""
    if len(items) <= count:
        return items
    picks = sorted({round(i * (len(items) - 1) / (count - 1)) for i in range(count)})
    return [items[i] for i in picks]


def _thumbnail(png: Path) -> bytes:
    from PIL import Image

    with Image.open(png) as image:
        small = image.convert("RGB")
    small.thumbnail((THUMBNAIL_WIDTH, THUMBNAIL_WIDTH * 4))
    buffer = io.BytesIO()
    small.save(buffer, format="JPEG", quality=70)
    return buffer.getvalue()


EDIT_NOTE = (
    "<p>An editing run: each row of a training grid starts with the source image (captioned "
    "<em>source image</em>) that the results after it edit; an evaluation grid shows each "
    "source image before its edit, two pairs a row.</p>"
)


def _grids(samples: Path, edits: bool) -> str:
    """The chosen grids as thumbnails, each a link to its PNG (report/ sits beside samples/);
    `edits`: the run edits source images, which its grids show."""
    if not samples.is_dir():
        return ""
    paths = sorted(samples.glob("*.png"))
    evals = [p for p in paths if p.name.startswith("eval-")]
    chosen = _spread([p for p in paths if p not in evals], MAX_GRIDS) + _spread(evals, MAX_GRIDS)
    skipped = len(paths) - len(chosen)
    note = f"<p>{skipped} more grids in <code>samples/</code>.</p>" if skipped else ""
    note += EDIT_NOTE if edits else ""
    return note + "".join(
        f'<h3>{html.escape(p.stem)}</h3><a href="../samples/{html.escape(p.name)}">'
        f"{_img(_thumbnail(p), p.stem, 'image/jpeg')}</a>"
        for p in chosen
    )


def best_in_log(log: list[dict[str, Any]]) -> Best | None:
    """The best held-out evaluation among the log's lines (store.evaluations' rule, on the
    same eval/iter-N values the run's best.json is derived from)."""
    return best_of((line["iteration"], line[METRIC]) for line in log if METRIC in line)


def _best_line(log: list[dict[str, Any]]) -> str:
    best = best_in_log(log)
    if best is None:
        return ""
    return f"<p>Best held-out evaluation: {html.escape(describe_best(best))}.</p>"


def _summary_table(log: list[dict[str, Any]]) -> str:
    columns = ["iteration", "reward/mean", "eval/reward_mean", "update/kl_reference",
               "update/kl_gaussian", "update/clipfrac", "update/logprob_gap_max",
               "rollout/seconds", "update/seconds"]  # fmt: skip
    columns = [c for c in columns if any(c in line for line in log)]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    rows = []
    for line in log:
        cells = []
        for column in columns:
            value = line.get(column)
            text = "" if value is None else (str(value) if column == "iteration"
                                            else f"{value:.4g}")  # fmt: skip
            if column == "iteration" and "reward/mean" not in line:
                # no iteration ran: the evaluation after the last one, or of the base alone
                text += " (base model)" if line["iteration"] == 0 else " (final evaluation)"
            cells.append(f"<td>{text}</td>")
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1400px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 2em; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; }
.plots img { width: 640px; border: 1px solid #ddd; }
.grids img { max-width: 100%; border: 1px solid #ddd; margin-bottom: 1em; }
table { border-collapse: collapse; font-size: 0.85em; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
"""


def write_report(run: RunDir) -> Path:
    """Write RUN/report/index.html and one PNG per plot; returns the HTML path."""
    log = read_log(run)
    if not log:
        raise FlowGrpoError(f"{run.metrics_path} is missing or empty: run `flowgrpo loop` first")
    out = run.root / "report"
    # A report takes no lock (it runs beside a training loop): it removes what killed reports
    # left, and leaves a running one's files alone.
    remove_temp_files(out, ended_only=True)
    keys = set().union(*log)
    plots = []
    for plot in _plots(keys):
        png = _draw(plot, log)
        atomic_write_bytes(out / f"{plot.name}.png", png)
        plots.append(_img(png, plot.title))
    grids = _grids(run.root / "samples", has_source_images(run))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>flowgrpo report: {html.escape(run.root.name)}</title>
<style>{STYLE}</style></head><body>
<h1>flowgrpo run <code>{html.escape(str(run.root))}</code></h1>
<p>{len([x for x in log if "update/loss" in x])} training iteration(s).
Train reward: mean over each iteration's rollout images. Eval: ODE sampling of fixed held-out
prompts with fixed seeds.</p>
{_best_line(log)}
<h2>Curves</h2><div class="plots">{"".join(plots)}</div>
<h2>Iterations</h2>
<p>Row N is iteration N: its rollout, sampled by the policy after N updates, its scores, and
its update, the (N+1)-th, whose weights are checkpoint iter-N. Its <code>eval/*</code> columns
evaluate the policy after N updates (<code>eval/iter-N</code>, the weights of checkpoint
iter-(N-1); N = 0: the base model). The row marked final evaluation has no iteration: it is
the evaluation of the policy after N updates, the last checkpoint's; a row 0 marked base model
is the base model's evaluation in a run that has not trained yet.</p>
{_summary_table(log)}
<h2>Sample grids</h2><div class="grids">{grids}</div>
</body></html>
"""
    atomic_write_bytes(out / "index.html", page.encode())
    return out / "index.html"

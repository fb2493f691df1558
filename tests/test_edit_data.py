"""Editing data sets from prompt file to reward: `prepare` reads each row's source image (a path
in jsonl / csv, bytes in parquet), checks it and keeps it as PNG with its input's SHA-256;
rollout hands it to an edit family's adapter (qwenimage_edit, flux_kontext), score and the
plugins get it as `source_images`; a text-to-image model with edit prompts, or the reverse,
stops at once. The grids and the report show each source image beside its results."""

import base64
import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from flowgrpo_cli.cli import app

runner = CliRunner()
JPEG = "reward.weights={jpeg_compressibility = 1.0}"
EDITS = ["make the sky red", "add a small cat", "turn it into a sketch", "remove the tree"]
EDIT_FAMILIES = ["qwenimage_edit", "flux_kontext"]
# Sources a loop edits: FluxKontextPipeline rounds their sides down to multiples of 16 pixels
# before it reads their aspect ratio, so they must be at least that.
LOOP_SOURCE = (48, 32)
# 1 - mean |result - source| over RGB in [0, 1], the source resized to the result's size.
PLUGIN = """
import numpy as np
from PIL import Image

def score(images, prompts, metadata, source_images):
    out = []
    for image, source in zip(images, source_images, strict=True):
        a = np.asarray(image.convert("RGB"), dtype=np.float64) / 255
        b = np.asarray(source.resize(image.size, Image.Resampling.BILINEAR), dtype=np.float64) / 255
        out.append(1 - np.abs(a - b).mean())
    return out

score.needs = {"images", "source_images"}
"""


def pixels(seed: int, width: int = 12, height: int = 9) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def write_images(
    folder: Path, count: int = len(EDITS), size: tuple[int, int] = (12, 9)
) -> list[np.ndarray]:
    """images/0.png ... in `folder`, each a seeded random RGB image of `size` (width, height)."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    arrays = [pixels(i, *size) for i in range(count)]
    for i, array in enumerate(arrays):
        (folder / f"images/{i}.png").write_bytes(png(array))
    return arrays


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def edit_jsonl(folder: Path, size: tuple[int, int] = (12, 9)) -> Path:
    write_images(folder, size=size)
    rows = [{"prompt": p, "image": f"images/{i}.png"} for i, p in enumerate(EDITS)]
    return write_jsonl(folder / "edits.jsonl", rows)


def prepare(tmp_path: Path, train: Path, *sets: str):
    args = ["prepare", "--run", str(tmp_path / "run"), "--train", str(train), "--test", str(train)]
    return runner.invoke(app, [*args, "--set", JPEG, *[a for s in sets for a in ("--set", s)]])


def stored(tmp_path: Path) -> dict:
    return pq.read_table(tmp_path / "run/data/train.parquet").to_pydict()


def test_jsonl_rows_keep_their_images_as_png_with_the_files_hash(tmp_path):
    train = edit_jsonl(tmp_path)
    result = prepare(tmp_path, train)
    assert result.exit_code == 0, result.output
    table = stored(tmp_path)
    assert table["prompt"] == EDITS
    pairs = zip(table["source_image"], table["source_sha256"], strict=True)
    for i, (data, digest) in enumerate(pairs):
        assert data.startswith(b"\x89PNG")
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), pixels(i))
        assert digest == hashlib.sha256((tmp_path / f"images/{i}.png").read_bytes()).hexdigest()


def test_source_size_resizes_every_source_and_lets_aspect_ratios_share_a_batch(make_run, tmp_path):
    """data.source_size stores each source resized as flow_grpo's edit trainers resize theirs
    (PIL's default filter); without it two aspect ratios cannot share a rollout batch."""
    from helpers import do_rollout, small_edit_sources

    from flowgrpo_cli.errors import FlowGrpoError

    (tmp_path / "images").mkdir()
    arrays = [pixels(0, 24, 6), pixels(1, 6, 24)]  # 4:1 and 1:4
    for i, array in enumerate(arrays):
        (tmp_path / f"images/{i}.png").write_bytes(png(array))
    rows = [{"prompt": EDITS[i], "image": f"images/{i}.png"} for i in range(2)]
    train = write_jsonl(tmp_path / "mixed.jsonl", rows)
    assert prepare(tmp_path, train, "data.source_size=[20, 16]").exit_code == 0
    for data, array in zip(stored(tmp_path)["source_image"], arrays, strict=True):
        expected = np.asarray(Image.fromarray(array).resize((20, 16), Image.Resampling.BICUBIC))
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), expected)

    with small_edit_sources():  # 4 images, both prompts, one rollout batch
        config, run = make_run(
            f"data.train={train}", f"data.test={train}", "data.source_size=[20, 16]",
            family="qwenimage_edit",
        )  # fmt: skip
        do_rollout(config, run)
        config, run = make_run(
            f"data.train={train}", f"data.test={train}", family="qwenimage_edit", name="own"
        )
        with pytest.raises(FlowGrpoError, match=r"different aspect ratios.*data\.source_size"):
            do_rollout(config, run)


def test_one_instruction_on_two_images_is_no_duplicate(tmp_path):
    """An edit is the instruction and its source: the same words for another image are a
    different row, the same words for the same image a duplicate (and a train-test overlap)."""
    write_images(tmp_path, 2)
    rows = [{"prompt": "remove the tree", "image": f"images/{i}.png"} for i in (0, 1, 0)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    test = write_jsonl(tmp_path / "test.jsonl", rows[1:2])
    args = ["prepare", "--run", str(tmp_path / "run"), "--train", str(train), "--test", str(test)]
    result = runner.invoke(app, [*args, "--set", JPEG])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "run/data/manifest.json").read_text())["summary"]
    where = [f"{train}:1", f"{train}:3"]
    assert summary["duplicates"]["train"] == [{"prompt": "remove the tree", "sources": where}]
    assert summary["train_test_overlap"] == ["remove the tree"]  # image 1, in both


@pytest.mark.parametrize("size", ["[20]", "[20, 8]", "[20, 16, 3]"])
def test_a_bad_source_size_names_the_key(tmp_path, size):
    result = prepare(tmp_path, edit_jsonl(tmp_path), f"data.source_size={size}")
    assert result.exit_code != 0
    assert "data.source_size" in result.output and "[width, height]" in result.output


def test_csv_paths_are_relative_to_the_file(tmp_path):
    folder = tmp_path / "data"
    write_images(folder)
    lines = ["prompt,image", *[f"{p},images/{i}.png" for i, p in enumerate(EDITS)]]
    train = folder / "edits.csv"
    train.write_text("\n".join(lines) + "\n")
    result = prepare(tmp_path, train)
    assert result.exit_code == 0, result.output
    images = stored(tmp_path)["source_image"]
    assert [np.asarray(Image.open(io.BytesIO(d))).tolist() for d in images] == [
        pixels(i).tolist() for i in range(len(EDITS))
    ]


def test_parquet_holds_bytes_plain_or_in_the_hugging_face_struct(tmp_path):
    """Hugging Face datasets' Image struct (with bytes, or with a path relative to the file
    alone), and a plain binary column."""
    arrays = write_images(tmp_path)
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    cells = {
        "hf": [{"bytes": png(a), "path": "elsewhere.png"} for a in arrays],
        "hf_path": [{"bytes": None, "path": f"images/{i}.png"} for i in range(len(arrays))],
    }
    for name, values in cells.items():
        table = pa.table({"prompt": EDITS, "image": pa.array(values, struct)})
        pq.write_table(table, tmp_path / f"{name}.parquet")
    pq.write_table(
        pa.table({"prompt": EDITS, "image": pa.array([png(a) for a in arrays], pa.binary())}),
        tmp_path / "plain.parquet",
    )
    for name in ("hf", "hf_path", "plain"):
        result = runner.invoke(app, [
            "prepare", "--run", str(tmp_path / name), "--train", str(tmp_path / f"{name}.parquet"),
            "--test", str(tmp_path / f"{name}.parquet"), "--set", JPEG,
        ])  # fmt: skip
        assert result.exit_code == 0, result.output
        table = pq.read_table(tmp_path / name / "data/train.parquet").to_pydict()
        for i, data in enumerate(table["source_image"]):
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), arrays[i])
            assert table["source_sha256"][i] == hashlib.sha256(png(arrays[i])).hexdigest()


def test_an_exif_rotated_photo_is_stored_upright(tmp_path):
    """Orientation 6 (the camera was turned clockwise): shown rotated 90 degrees clockwise."""
    array = pixels(0)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(array).save(tmp_path / "photo.png", exif=exif)
    train = write_jsonl(tmp_path / "edits.jsonl", [{"prompt": "a", "image": "photo.png"}])
    assert prepare(tmp_path, train).exit_code == 0
    data = stored(tmp_path)["source_image"][0]
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), np.rot90(array, k=-1))


def test_a_text_data_set_has_no_image_columns(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": p} for p in EDITS])
    assert prepare(tmp_path, train).exit_code == 0
    assert "source_image" not in stored(tmp_path)


@pytest.mark.parametrize(
    ("image", "make", "message"),
    [
        ("images/missing.png", None, "image {folder}/images/missing.png does not exist"),
        ("images", None, "image {folder}/images is a folder, not a file"),
        ("notes.png", b"not an image", "image {folder}/notes.png cannot be read as an image"),
        ("big.png", png(pixels(0, 11, 10)),
         "image {folder}/big.png is 11 x 10 = 110 pixels, over data.max_image_pixels = 108"),
        ("cut.png", png(pixels(0))[:60], "image {folder}/cut.png cannot be read as an image"),
        (3, None, "image is not a path or image bytes: 3"),
    ],
)  # fmt: skip
def test_a_bad_image_is_an_error_at_its_line(tmp_path, image, make, message):
    write_images(tmp_path)
    if make is not None:
        (tmp_path / image).write_bytes(make)
    rows = [{"prompt": EDITS[0], "image": "images/0.png"}, {"prompt": EDITS[1], "image": image}]
    train = write_jsonl(tmp_path / "edits.jsonl", rows)
    result = prepare(tmp_path, train, "data.max_image_pixels=108")
    assert result.exit_code == 1
    assert f"{train}:2: " + message.format(folder=tmp_path) in " ".join(result.output.split())
    assert "Traceback" not in result.output
    assert not (tmp_path / "run" / "data").exists()


def test_bad_bytes_in_parquet_are_an_error_at_their_row(tmp_path):
    data = pa.array([png(pixels(0)), b"\x89PNG broken"], pa.binary())
    path = tmp_path / "edits.parquet"
    pq.write_table(pa.table({"prompt": EDITS[:2], "image": data}), path)
    result = prepare(tmp_path, path)
    assert result.exit_code == 1
    assert f"{path}:row 1: the image bytes cannot be read as an image" in result.output


def test_mixed_rows_name_the_first_prompt_without_an_image(tmp_path):
    write_images(tmp_path)
    rows = [
        {"prompt": EDITS[0], "image": "images/0.png"},
        {"prompt": EDITS[1]},
        {"prompt": EDITS[2], "image": ""},
    ]
    train = write_jsonl(tmp_path / "edits.jsonl", rows)
    result = prepare(tmp_path, train)
    assert result.exit_code == 1
    flat = " ".join(result.output.split())
    assert f"{train}:2: no `image` for 'add a small cat', but {train}:1 has one" in flat


@pytest.mark.parametrize(
    ("name", "settings"),
    [
        ("similarity:score", []),
        ("source_similarity", []),
        ("remote", ["reward.remote.url=http://scorer:8000/score",
                    'reward.remote.needs=["source_images"]']),
        ("vlm", ["reward.vlm.url=http://judge:8000", "reward.vlm.model=judge",
                 "reward.vlm.with_source_image=true"]),
    ],
)  # fmt: skip
def test_a_reward_that_reads_source_images_refuses_a_text_data_set(tmp_path, name, settings):
    (tmp_path / "similarity.py").write_text(PLUGIN)
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": p} for p in EDITS])
    result = prepare(
        tmp_path, train, f'reward.plugin_dirs=["{tmp_path}"]',
        f"reward.weights={{'{name}' = 1.0}}", *settings,
    )  # fmt: skip
    assert result.exit_code == 1
    assert f"{train}:1: no `image` for 'make the sky red'; the `{name}` reward" in (
        " ".join(result.output.split())
    )


def similarity(result: Image.Image, source: Image.Image) -> float:
    """The plugin's reward, worked out here on its own: 1 - mean absolute difference."""
    a = np.asarray(result, dtype=np.float64) / 255
    b = np.asarray(source.resize(result.size, Image.Resampling.BILINEAR), dtype=np.float64) / 255
    return float(1 - np.abs(a - b).mean())


def expected(row: dict, folder: Path) -> float:
    """The reward of a saved result image, from the source file its prompt names."""
    source = Image.open(folder / f"images/{EDITS.index(row['prompt'])}.png")
    return similarity(Image.open(io.BytesIO(row["image"])).convert("RGB"), source)


@pytest.mark.slow
@pytest.mark.parametrize("family", EDIT_FAMILIES)
def test_two_loop_iterations_on_the_edit_model_reward_each_result_against_its_source(
    make_run, tmp_path, family
):
    """The default algorithm, 2 prompts x 2 images an iteration, an evaluation of 2 held-out
    prompts before each iteration and after the last; every recorded reward is the plugin's
    function of the saved image and its prompt's source, worked out again here."""
    from flowgrpo_cli.store.metrics_log import read_log
    from flowgrpo_cli.store.rundir import ROLLOUT, SCORE
    from flowgrpo_cli.store.trajectory import read_table

    def parts(folder: Path, columns: list[str]) -> list[dict]:
        return read_table(sorted(folder.glob("part-*.arrow")), columns).to_pylist()

    (tmp_path / "similarity.py").write_text(PLUGIN)
    train = edit_jsonl(tmp_path, size=LOOP_SOURCE)
    _, run = make_run(
        f"data.train={train}", f"data.test={train}", f'reward.plugin_dirs=["{tmp_path}"]',
        "reward.weights={'similarity:score' = 1.0}", "sampler.guidance_scale=1.0",
        "eval.every=2", "eval.num_prompts=2", "eval.num_steps=2", "eval.guidance_scale=1.0",
        family=family,
    )  # fmt: skip
    result = runner.invoke(app, ["loop", "--run", str(run.root), "-n", "2"])
    assert result.exit_code == 0, result.output
    updates = [line for line in read_log(run) if any(k.startswith("update/") for k in line)]
    assert len(updates) == 2  # and a third line: the evaluation after the last update
    # On-policy: the update's forwards (the stored source latents appended) give the rollout's
    # log-probs back.
    assert all(line["update/logprob_gap_max"] < 1e-6 for line in updates)
    assert (run.checkpoint_dir(1) / "manifest.json").is_file()

    for iteration in (0, 1):
        rollout = parts(run.stage_dir(iteration, ROLLOUT), ["sample_id", "prompt", "image"])
        scores = parts(run.stage_dir(iteration, SCORE), ["sample_id", "similarity:score"])
        recorded = {row["sample_id"]: row["similarity:score"] for row in scores}
        assert len(rollout) == len(recorded) == 4
        for row in rollout:
            assert recorded[row["sample_id"]] == pytest.approx(expected(row, tmp_path), 1e-12)
    evaluated = parts(run.eval_dir(0), ["prompt", "image", "similarity:score"])
    assert [row["prompt"] for row in evaluated] == EDITS[:2]
    for row in evaluated:
        assert row["similarity:score"] == pytest.approx(expected(row, tmp_path), 1e-12)


@pytest.mark.slow
def test_two_loop_iterations_on_the_edit_model_with_source_similarity(make_run, tmp_path):
    """The built-in edit-consistency reward on a tiny random DINOv2: 2 iterations of 2 prompts
    x 2 images train, and every recorded score is the cosine of the saved image and its
    prompt's source file, worked out again here from the encoder's own features."""
    from transformers import AutoImageProcessor, Dinov2Model

    from flowgrpo_cli.models.tiny import build_tiny_dinov2
    from flowgrpo_cli.store.rundir import ROLLOUT, SCORE, read_manifest
    from flowgrpo_cli.store.trajectory import read_table

    dino = build_tiny_dinov2(tmp_path / "dino")
    train = edit_jsonl(tmp_path)
    _, run = make_run(
        f"data.train={train}", f"data.test={train}", "sampler.guidance_scale=1.0",
        "reward.weights={source_similarity = 1.0}", 'reward.device="cpu"',
        f'reward.source_similarity.model="{dino}"', family="qwenimage_edit",
    )  # fmt: skip
    result = runner.invoke(app, ["loop", "--run", str(run.root), "-n", "2"])
    assert result.exit_code == 0, result.output
    assert (run.checkpoint_dir(1) / "manifest.json").is_file()

    model = Dinov2Model.from_pretrained(dino).eval()
    processor = AutoImageProcessor.from_pretrained(dino)

    def cls(image: Image.Image) -> np.ndarray:
        with torch.no_grad():
            out = model(**processor(images=[image.convert("RGB")], return_tensors="pt"))
        return out.pooler_output[0].double().numpy()

    for iteration in (0, 1):
        folder = run.stage_dir(iteration, ROLLOUT)
        rollout = read_table(sorted(folder.glob("part-*.arrow")), ["sample_id", "prompt", "image"])
        scores = read_table(
            sorted(run.stage_dir(iteration, SCORE).glob("part-*.arrow")),
            ["sample_id", "source_similarity"],
        ).to_pylist()
        recorded = {row["sample_id"]: row["source_similarity"] for row in scores}
        assert len(recorded) == 4
        for row in rollout.to_pylist():
            a = cls(Image.open(io.BytesIO(row["image"])))
            b = cls(Image.open(tmp_path / f"images/{EDITS.index(row['prompt'])}.png"))
            cosine = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
            assert recorded[row["sample_id"]] == pytest.approx(cosine, abs=1e-5)
    info = read_manifest(run.stage_dir(1, SCORE))["reward_info"]["source_similarity"]
    assert (info["backbone"], info["model"]) == ("dino", str(dino))


@pytest.mark.parametrize(
    ("text_family", "edit_family"), [("qwenimage", "qwenimage_edit"), ("flux", "flux_kontext")]
)
def test_the_wrong_family_for_the_data_stops_the_rollout(
    make_run, tmp_path, text_family, edit_family
):
    from helpers import do_rollout

    from flowgrpo_cli.errors import FlowGrpoError

    train = edit_jsonl(tmp_path)
    config, run = make_run(f"data.train={train}", f"data.test={train}", family=text_family)
    with pytest.raises(FlowGrpoError, match=r"generates from text alone: set model\.path"):
        do_rollout(config, run)
    config, run = make_run(family=edit_family, name="text")  # the default text prompts
    with pytest.raises(FlowGrpoError, match=r"prepare an editing data set.*`image` column"):
        do_rollout(config, run)


def shown(png: bytes, height: int) -> np.ndarray:
    """An image as make_grid draws it: scaled to the cell's width."""
    from flowgrpo_cli.reporting.grid import CELL

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB").resize((CELL, height)))


def test_grids_and_report_show_each_source_beside_its_results(make_run, tmp_path):
    """One iteration, evaluated before and after: each row of the training grid is a group,
    its prompt's source image first; the evaluation grid shows each source before its edit,
    two pairs a row; pixel for pixel where make_grid puts them. The report explains it and
    inlines both grids, linked to their PNGs."""
    from html.parser import HTMLParser

    from helpers import small_edit_sources

    from flowgrpo_cli.loop import run_loop
    from flowgrpo_cli.reporting.grid import CAPTION_LINES, CELL, LINE_HEIGHT
    from flowgrpo_cli.reporting.report import THUMBNAIL_WIDTH, write_report
    from flowgrpo_cli.stages.evaluate import evaluation_requests
    from flowgrpo_cli.store.datatable import source_images
    from flowgrpo_cli.store.rundir import ROLLOUT
    from flowgrpo_cli.store.trajectory import read_table

    train = edit_jsonl(tmp_path)
    config, run = make_run(
        f"data.train={train}", f"data.test={train}", "sampler.guidance_scale=1.0",
        "eval.every=1", "eval.num_steps=2", "eval.guidance_scale=1.0",
        family="qwenimage_edit",
    )  # fmt: skip
    with small_edit_sources():
        run_loop(config, run, 1)
    # Rows as tall as a 64 x 64 result shown CELL wide; a 12 x 9 source is shown 3/4 as tall.
    row, source_height = CELL + CAPTION_LINES * LINE_HEIGHT + 6, CELL * 9 // 12

    def cell(grid: Image.Image, column: int, number: int, height: int) -> np.ndarray:
        x, y = column * CELL, number * row
        return np.asarray(grid.crop((x, y, x + CELL, y + height)))

    rollout = read_table(sorted(run.stage_dir(0, ROLLOUT).glob("part-*.arrow")),
                         ["group_id", "prompt_index", "image"]).to_pylist()  # fmt: skip
    groups: dict[int, list[dict]] = {}
    for sample in rollout:
        groups.setdefault(sample["group_id"], []).append(sample)
    sources = source_images(run, "train", [s["prompt_index"] for s in rollout])
    grid = Image.open(run.samples_path(0))
    assert grid.size == (5 * CELL, len(groups) * row)  # the source and up to 4 results a row
    for number, samples in enumerate(groups.values()):
        expected = shown(sources[samples[0]["prompt_index"]], source_height)
        assert np.array_equal(cell(grid, 0, number, source_height), expected)
        for column, sample in enumerate(samples, 1):
            assert np.array_equal(cell(grid, column, number, CELL), shown(sample["image"], CELL))
        assert (cell(grid, len(samples) + 1, number, row) == 255).all()  # blank after them

    requests = evaluation_requests(config, run)
    evaluated = read_table(sorted(run.eval_dir(1).glob("part-*.arrow")), ["image"]).to_pylist()
    grid = Image.open(run.eval_samples_path(1))
    assert grid.size == (4 * CELL, 2 * row) and len(requests) == len(evaluated) == 4
    for k, (request, result) in enumerate(zip(requests, evaluated, strict=True)):
        number, column = k // 2, 2 * (k % 2)
        expected = shown(request.source_image, source_height)
        assert np.array_equal(cell(grid, column, number, source_height), expected)
        assert np.array_equal(cell(grid, column + 1, number, CELL), shown(result["image"], CELL))

    class Page(HTMLParser):
        def __init__(self):
            super().__init__()
            self.links: dict[str, str] = {}  # grid PNG -> the thumbnail inlined in its link
            self.href = None

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            if tag == "a":
                self.href = attrs["href"]
            elif tag == "img" and self.href is not None:
                self.links[self.href] = attrs["src"]

        def handle_endtag(self, tag):
            if tag == "a":
                self.href = None

    html = write_report(run).read_text()
    page = Page()
    page.feed(html)
    assert "An editing run: each row of a training grid starts with the source image" in html
    wanted = ["iter-000000.png", "eval-iter-000000.png", "eval-iter-000001.png"]
    assert sorted(page.links) == sorted(f"../samples/{name}" for name in wanted)
    for href, src in page.links.items():
        png = Image.open(run.root / "report" / href)
        head, data = src.split(",", 1)
        assert head == "data:image/jpeg;base64"
        thumbnail = Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")
        assert thumbnail.size[0] == min(THUMBNAIL_WIDTH, png.size[0])
        # The thumbnail is the grid, source and results alike, scaled down (JPEG: to a few
        # levels).
        scaled = np.asarray(png.convert("RGB").resize(thumbnail.size), dtype=float)
        assert np.abs(np.asarray(thumbnail, dtype=float) - scaled).mean() < 4

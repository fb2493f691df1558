"""The model card of `flowgrpo export` says enough to redraw an evaluation image.

A reader has the exported folder and its README.md, nothing of flowgrpo: the card's numbers
(steps, guidance, size, seed and prompt of test prompt 0) and its plain diffusers code, run in
a process that cannot import flowgrpo, must give back the image the run's evaluation stored.
"""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.store.rundir import read_manifest
from flowgrpo_cli.store.trajectory import iter_batches

# The reader's process cannot import flowgrpo: the card's code must not need it.
NO_FLOWGRPO = (
    "import sys\nsys.modules['flowgrpo_cli'] = None  # an import of flowgrpo would fail here\n"
)


def _flowgrpo(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _code_blocks(card: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", card, flags=re.S | re.M)


def _number(card: str, name: str) -> str:
    found = re.search(rf"`{name} = ([0-9.]+)`", card)
    assert found, f"the card does not state {name}:\n{card}"
    return found.group(1)


def _stored_eval_image(run, iteration: int, sample_id: str) -> tuple[str, np.ndarray]:
    """(prompt, HxWx3 uint8 image) of `sample_id` in the run's eval/iter-N parts."""
    folder = run.eval_dir(iteration)
    manifest = read_manifest(folder)
    paths = [folder / part["name"] for part in manifest["parts"]]
    for batch in iter_batches(paths, ["sample_id", "prompt", "image"]):
        for row in batch.to_pylist():
            if row["sample_id"] == sample_id:
                image = Image.open(io.BytesIO(row["image"])).convert("RGB")
                return row["prompt"], np.asarray(image)
    raise AssertionError(f"{sample_id} is not in {folder}")


def test_card_redraws_an_evaluation_image_in_plain_diffusers(make_run, tiny_model_dir, tmp_path):
    # Numbers unlike the defaults, and a non-square size, so a card that swapped or
    # hard-coded one would draw another image.
    _, run = make_run(
        "eval.every=2", "eval.num_prompts=2", "eval.num_steps=4", "eval.guidance_scale=3.0",
        "model.width=48", "run.seed=7", "train.lr=0.05",
    )  # fmt: skip
    trained = _flowgrpo("loop", "--run", run.root, "-n", "2")
    assert trained.exit_code == 0, trained.output
    out = tmp_path / "exports" / "model"
    exported = _flowgrpo("export", run.root, out)
    assert exported.exit_code == 0, exported.output
    card = (out / "README.md").read_text()

    # Published text: no path of this machine, the base named by its folder's name.
    base = tiny_model_dir("sd3")
    assert str(tmp_path) not in card and str(base) not in card and str(base.parent) not in card
    assert f"`{base.name}` (a local folder" in card
    assert "base_model:" not in card  # hub metadata only for hub ids
    assert "\nlicense: other\n" in card and "base model's licence applies" in card
    assert "- weights exported: the trained weights (not the EMA)" in card
    assert "- weights the run evaluates: the trained weights (not the EMA)" in card
    assert "`jpeg_compressibility` x 1" in card
    assert "noise level 0" in card
    assert "`flowgrpo export run model`" in card

    # The settings, read from the card's text alone.
    steps = int(_number(card, "num_inference_steps"))
    guidance = float(_number(card, "guidance_scale"))
    height, width = int(_number(card, "height")), int(_number(card, "width"))
    assert (steps, guidance, height, width) == (4, 3.0, 64, 48)
    row = re.search(r"^\| 0 \| `(eval-p\d+)` \| (\d+) \| (.*?) \| (.*?) \|$", card, flags=re.M)
    assert row, card
    sample_id, seed, prompt = row.group(1), int(row.group(2)), row.group(3)
    assert row.group(4) == "(none)"

    # The seed rule as the card writes it gives test prompt 0's seed.
    rule = next(block for block in _code_blocks(card) if "seed_i =" in block)
    names: dict = {"i": 0}
    exec(rule, names)  # the card's own lines: the seed rule, stdlib hashlib only
    assert names["seed_i"] == seed
    assert re.search(r"torch\.Generator\(\"cpu\"\)\.manual_seed\(seed_i\)", card)
    assert "torch.randn((1, " in card and "dtype=torch.float32" in card

    # The card's code: plain diffusers, the numbers above.
    code = next(block for block in _code_blocks(card) if "image = pipe(" in block)
    assert "flowgrpo" not in code
    imported = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported <= {"torch", "diffusers", "PIL"}, imported
    literals = dict(re.findall(r"^(prompt|seed) = (.+?)(?:  #.*)?$", code, flags=re.M))
    assert ast.literal_eval(literals["prompt"]) == prompt
    assert ast.literal_eval(literals["seed"]) == seed
    for argument in (f"num_inference_steps={steps},", f"guidance_scale={guidance!r},",
                     f"height={height},", f"width={width},"):  # fmt: skip
        assert argument in code, (argument, code)

    # Run it as a reader would: their copy of the base and this folder in place of the names.
    loaded = re.search(r'from_pretrained\("([^"]+)"', code).group(1)
    assert loaded == base.name
    script = code.replace(f'"{loaded}"', repr(str(base))).replace(
        '"THIS_FOLDER_OR_REPO"', repr(str(out))
    )
    workdir = tmp_path / "reader"
    workdir.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [sys.executable, "-c", NO_FLOWGRPO + script], cwd=workdir, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    redrawn = np.asarray(Image.open(workdir / f"{sample_id}.png").convert("RGB"))

    # The evaluation of these weights: eval/iter-2, the policy after 2 updates.
    stored_prompt, stored = _stored_eval_image(run, 2, sample_id)
    assert stored_prompt == prompt
    assert redrawn.shape == stored.shape == (height, width, 3)
    difference = np.abs(redrawn.astype(int) - stored.astype(int))
    assert difference.max() <= 1, difference.max()  # float rounding may flip one 8-bit level
    # The comparison means something: the base model draws another image with this seed.
    _, base_image = _stored_eval_image(run, 0, sample_id)
    assert np.abs(base_image.astype(int) - stored.astype(int)).max() > 2


def test_card_carries_the_base_models_licence(tmp_path):
    from flowgrpo_cli.model_card import BaseModelInfo

    folder = tmp_path / "my-base"
    folder.mkdir()
    (folder / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    (folder / "README.md").write_text(
        "---\nlicense: other\nlicense_name: stabilityai-ai-community\n"
        "license_link: LICENSE.md\ntags:\n- x\n---\n# card\n"
    )
    base = BaseModelInfo.read(str(folder))
    assert base.name == "my-base" and base.local and base.family == "sd3"
    assert base.license_front_matter() == [
        "license: other", "license_name: stabilityai-ai-community", "license_link: LICENSE.md",
    ]  # fmt: skip
    (folder / "README.md").write_text("no front matter\n")
    assert BaseModelInfo.read(str(folder)).license_front_matter() == ["license: other"]
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    assert "`apache-2.0`" in BaseModelInfo.read(str(folder)).license_sentence()

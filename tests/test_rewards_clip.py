"""The CLIP rewards (pickscore, clipscore, aesthetic) on a tiny random CLIP built from a config
and loaded through the same from_pretrained path as the released models: values checked by
hand from given embeddings, batching, dtypes, hub revisions and what the run records."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from PIL import Image

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models.tiny import build_tiny_clip, save_tiny_aesthetic_head
from flowgrpo_cli.rewards import RewardBatch, build_rewards
from flowgrpo_cli.rewards.clip import ClipModel, load_aesthetic_head
from flowgrpo_cli.rewards.registry import reward_needs
from flowgrpo_cli.store.config import (
    STAGE_SECTIONS,
    AestheticSection,
    ClipScoreSection,
    PickScoreSection,
    RewardSection,
    config_hash,
    load_config,
)

EMBEDDING = 16  # the tiny CLIP's projection width


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip")
    build_tiny_clip(root / "clip", projection_dim=EMBEDDING)
    save_tiny_aesthetic_head(root / "head" / "aesthetic-model.pth", EMBEDDING)
    return root


def options(models, **changes) -> RewardSection:
    """The [reward] table of the tiny models on the CPU, with `changes` on top."""
    clip = str(models / "clip")
    settings = dict(
        device="cpu", pickscore=PickScoreSection(model=clip, processor=clip),
        clipscore=ClipScoreSection(model=clip),
        aesthetic=AestheticSection(model=clip, head=str(models / "head")),
    )  # fmt: skip
    return RewardSection(**{**settings, **changes})


def batch(count: int = 5) -> RewardBatch:
    generator = torch.Generator().manual_seed(1)
    images = [
        Image.fromarray(torch.randint(0, 256, (32, 48, 3), generator=generator).byte().numpy())
        for _ in range(count)
    ]
    prompts = ["a cat", 'a sign that says "OPEN"', "x", "a very long prompt " * 20, "dog"]
    return RewardBatch(images, (prompts * count)[:count])


def scores(models, names, **changes) -> dict[str, list[float]]:
    with build_rewards(dict.fromkeys(names, 1.0), options(models, **changes)) as rewards:
        return rewards.score(batch()).columns


def test_values_from_given_embeddings_by_hand(models, monkeypatch):
    # Image i and text i embed to the given unit vectors: cos = 0.6, 0 and -1.
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    texts = torch.tensor([[0.6, 0.8], [1.0, 0.0], [-1.0, 0.0]])
    monkeypatch.setattr(ClipModel, "image_embeddings", lambda self, _: images)
    monkeypatch.setattr(ClipModel, "text_embeddings", lambda self, _: texts)
    with build_rewards({"clipscore": 1.0, "pickscore": 1.0}, options(models)) as rewards:
        pick = rewards._rewards[1]
        with torch.no_grad():
            pick.clip.model.logit_scale.fill_(math.log(52.0))  # exp(scale) / 26 = 2
        result = rewards.score(batch(3))
    assert result.columns["clipscore"] == pytest.approx([0.6, 0.0, -1.0], abs=1e-6)
    assert result.columns["pickscore"] == pytest.approx([1.2, 0.0, -2.0], abs=1e-5)


def test_clipscore_is_the_cosine_of_the_models_own_embeddings(models):
    """Against transformers' CLIPModel called directly on the same inputs."""
    from transformers import AutoProcessor, CLIPModel

    model = CLIPModel.from_pretrained(models / "clip").eval()
    processor = AutoProcessor.from_pretrained(models / "clip")
    data = batch(2)
    with torch.no_grad():
        image = model.get_image_features(
            **processor(images=data.images, return_tensors="pt")
        ).pooler_output
        text = model.get_text_features(
            **processor(text=data.prompts, padding=True, return_tensors="pt")
        ).pooler_output
    expected = torch.nn.functional.cosine_similarity(image, text).tolist()
    # batch(2) is the first two images and prompts of batch(5)
    assert scores(models, ["clipscore"])["clipscore"][:2] == pytest.approx(expected, abs=1e-5)


def test_aesthetic_is_the_head_on_the_unit_image_embedding(models):
    from transformers import AutoProcessor, CLIPModel

    model = CLIPModel.from_pretrained(models / "clip").eval()
    processor = AutoProcessor.from_pretrained(models / "clip")
    state = torch.load(models / "head" / "aesthetic-model.pth")
    data = batch(3)
    with torch.no_grad():
        x = model.get_image_features(
            **processor(images=data.images, return_tensors="pt")
        ).pooler_output
        x = x / x.norm(dim=-1, keepdim=True)
        for index in (0, 2, 4, 6, 7):  # the Linear layers; no activations between them
            x = x @ state[f"layers.{index}.weight"].T + state[f"layers.{index}.bias"]
    with build_rewards({"aesthetic": 1.0}, options(models)) as rewards:
        got = rewards.score(data).columns["aesthetic"]
    assert got == pytest.approx(x.squeeze(-1).tolist(), abs=1e-5)


def test_batches_give_the_one_by_one_scores(models):
    names = ["pickscore", "clipscore", "aesthetic"]
    one_by_one = scores(models, names, batch_size=1)
    for size in (2, 32):
        batched = scores(models, names, batch_size=size)
        for name in names:
            assert batched[name] == pytest.approx(one_by_one[name], abs=1e-5), (name, size)


def test_dtypes(models):
    full = scores(models, ["clipscore"], dtype="float32")["clipscore"]
    assert scores(models, ["clipscore"], dtype="auto")["clipscore"] == full  # CPU: float32
    with build_rewards({"clipscore": 1.0}, options(models, dtype="bfloat16")) as rewards:
        assert rewards._rewards[0].clip.model.dtype == torch.bfloat16
        assert rewards.info["clipscore"]["dtype"] == "bfloat16"
        half = rewards.score(batch()).columns["clipscore"]
    # bfloat16 weights move the embeddings a little; the cosine is still taken in float32.
    assert half == pytest.approx(full, abs=0.05)
    assert half != full


def test_needs_are_known_without_loading_a_model():
    assert reward_needs("pickscore") == {"images", "prompts"}
    assert reward_needs("clipscore") == {"images", "prompts"}
    assert reward_needs("aesthetic") == {"images"}


def _hub_cache(tmp_path, models, repo: str, commit: str):
    """A Hugging Face cache holding the tiny CLIP as `repo` at `commit` (branch main)."""
    cache = tmp_path / "hub"
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(models / "clip", repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return cache


def test_a_hub_id_is_read_at_the_commit_its_revision_names(models, tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    cache = _hub_cache(tmp_path, models, "tiny-org/clip", commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    hub = ClipScoreSection(model="tiny-org/clip")
    with build_rewards({"clipscore": 1.0}, options(models, clipscore=hub)) as rewards:
        assert rewards.info["clipscore"]["model"] == f"tiny-org/clip@{commit}"
        from_hub = rewards.score(batch()).columns["clipscore"]
    assert from_hub == scores(models, ["clipscore"])["clipscore"]

    with pytest.raises(FlowGrpoError, match=r"\[reward.clipscore\] model = 'tiny-org/gone'.*"
                       r"not downloaded yet"):  # fmt: skip
        gone = ClipScoreSection(model="tiny-org/gone")
        build_rewards({"clipscore": 1.0}, options(models, clipscore=gone))


def test_bad_model_sources_are_clear_errors(models, tmp_path):
    (tmp_path / "empty").mkdir()
    empty, clip = str(tmp_path / "empty"), str(models / "clip")
    pickscore = PickScoreSection(model=empty, processor=clip)
    with pytest.raises(FlowGrpoError, match=r"\[reward.pickscore\] model = .*empty'.*no config"):
        build_rewards({"pickscore": 1.0}, options(models, pickscore=pickscore))
    aesthetic = AestheticSection(model=clip, head=empty)
    with pytest.raises(FlowGrpoError, match=r"\[reward.aesthetic\] head = .*no aesthetic-model"):
        build_rewards({"aesthetic": 1.0}, options(models, aesthetic=aesthetic))
    wrong = save_tiny_aesthetic_head(tmp_path / "wide.pth", EMBEDDING * 2)
    with pytest.raises(FlowGrpoError, match=r"not an aesthetic predictor for 16-dimensional"):
        load_aesthetic_head(wrong, EMBEDDING)
    with pytest.raises(FlowGrpoError, match=r"`reward\.dtype` = 'half' is not one of 'auto'"):
        RewardSection(dtype="half")


def test_the_config_sets_the_models_and_counts_only_weighted_ones(models, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        f'[reward]\nweights = {{ ocr = 1.0 }}\n[reward.pickscore]\nmodel = "{models}/clip"\n'
    )
    base = load_config(None)
    ocr_only = load_config(path)
    assert ocr_only.reward.pickscore.model == f"{models}/clip"
    # pickscore is not weighted: its model does not change what the score stage computes.
    scores_hash = STAGE_SECTIONS["scores"]
    assert config_hash(ocr_only, scores_hash) == config_hash(base, scores_hash)
    weighted = load_config(path, ["reward.weights={pickscore=1.0}"])
    other = load_config(path, ["reward.weights={pickscore=1.0}", "reward.pickscore.revision=v2"])
    assert config_hash(weighted, scores_hash) != config_hash(other, scores_hash)


def test_flowgrpo_reward_takes_the_models_from_a_config(models, tmp_path):
    from typer.testing import CliRunner

    from flowgrpo_cli.cli import app

    image = tmp_path / "a.png"
    batch(1).images[0].save(image)
    config = tmp_path / "rewards.toml"
    config.write_text(
        f'[reward]\ndevice = "cpu"\nweights = {{ clipscore = 1.0, aesthetic = 0.1 }}\n'
        f'[reward.clipscore]\nmodel = "{models}/clip"\n'
        f'[reward.aesthetic]\nmodel = "{models}/clip"\nhead = "{models}/head"\n'
    )
    runner = CliRunner()
    result = runner.invoke(app, ["reward", "-c", str(config), "--prompt", "a cat", str(image)])
    assert result.exit_code == 0, result.output
    expected = scores(models, ["clipscore"])["clipscore"][0]
    assert f"{expected:.4f}" in result.output, result.output
    result = runner.invoke(
        app, ["reward", "-c", str(config), "--reward", "pickscore", "--prompt", "p", str(image)]
    )
    assert result.exit_code == 1  # the config names no PickScore folder: the hub, offline
    assert "[reward.pickscore] model = 'yuvalkirstain/PickScore_v1'" in result.output


def test_the_score_manifest_records_what_scored_the_run(models, make_run):
    from helpers import do_rollout, do_score

    from flowgrpo_cli.store.rundir import SCORE, read_manifest

    config, run = make_run(
        "reward.weights={clipscore = 1.0, jpeg_compressibility = 0.5}",
        f'reward.clipscore.model="{models}/clip"', 'reward.device="cpu"',
    )  # fmt: skip
    do_rollout(config, run)
    do_score(config, run)
    manifest = read_manifest(run.stage_dir(0, SCORE))
    assert manifest["reward_info"] == {
        "clipscore": {"weight": 1.0, "model": f"{models}/clip", "dtype": "float32"},
        "jpeg_compressibility": {"weight": 0.5, "jpeg_quality": "95"},
    }
    assert manifest["stats"]["clipscore"]["count"] == 4

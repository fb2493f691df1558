"""`source_similarity` on a tiny random DINOv2 and a tiny random CLIP, built from configs and
loaded through the same from_pretrained path as the released models: the cosine from given
embeddings by hand, then against the models' own features, each source embedded once,
batches, the checks on the models, and `flowgrpo reward --source`."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models.tiny import build_tiny_clip, build_tiny_dinov2
from flowgrpo_cli.rewards import RewardBatch, build_rewards
from flowgrpo_cli.rewards.registry import reward_needs
from flowgrpo_cli.rewards.source_similarity import paired_image_cosine
from flowgrpo_cli.store.config import (
    STAGE_SECTIONS,
    RewardSection,
    SourceSimilaritySection,
    config_hash,
    load_config,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    build_tiny_dinov2(root / "dino")
    build_tiny_clip(root / "clip")
    return root


def options(models, backbone: str = "dino", **changes) -> RewardSection:
    table = SourceSimilaritySection(backbone=backbone, model=str(models / backbone))
    return RewardSection(device="cpu", source_similarity=table, **changes)


def picture(seed: int, size: tuple[int, int] = (48, 32)) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator)
    return Image.fromarray(pixels.byte().numpy())


def edits(count: int = 4) -> RewardBatch:
    """`count` results; the sources of a group of two are one object, as the score stage gives
    them, at another size than the results."""
    sources: list[Image.Image] = []
    for i in range(count):
        sources.append(sources[-1] if i % 2 else picture(100 + i, (40, 40)))
    return RewardBatch([picture(i) for i in range(count)], source_images=sources)


def score(models, data: RewardBatch, backbone: str = "dino", **changes) -> list[float]:
    with build_rewards({"source_similarity": 1.0}, options(models, backbone, **changes)) as r:
        return r.score(data).columns["source_similarity"]


class Given:
    """An encoder whose embeddings are given per image (by its first pixel's red value)."""

    def __init__(self, vectors: dict[int, list[float]]) -> None:
        self.vectors, self.calls = vectors, []

    def image_embeddings(self, images):
        self.calls.append(len(images))
        rows = torch.tensor([self.vectors[image.getpixel((0, 0))[0]] for image in images])
        return rows / rows.norm(dim=-1, keepdim=True)


def test_the_cosine_of_given_embeddings_by_hand():
    """Results 1, 2, 3 against sources 10, 20, 10 (10 one object): (3, 4).(4, 3) / 25 = 0.96,
    (1, 0).(0, 1) = 0, (-3, -4).(4, 3) / 25 = -0.96; the shared source is embedded once."""
    red = {v: Image.new("RGB", (2, 2), (v, 0, 0)) for v in (1, 2, 3, 10, 20)}
    encoder = Given({1: [3.0, 4.0], 2: [1.0, 0.0], 3: [-3.0, -4.0], 10: [4.0, 3.0], 20: [0, 1]})
    images, sources = [red[1], red[2], red[3]], [red[10], red[20], red[10]]
    values = paired_image_cosine(encoder, images, sources)
    assert values.tolist() == pytest.approx([0.96, 0.0, -0.96], abs=1e-6)
    assert encoder.calls == [3, 2]  # the results, then the two distinct sources


def test_dino_is_the_cosine_of_the_models_cls_features(models):
    """Against transformers' Dinov2Model called directly: its pooler_output (the final
    layer-normed CLS token) of the processor's pixels, the cosine worked out here."""
    from transformers import AutoImageProcessor, Dinov2Model

    model = Dinov2Model.from_pretrained(models / "dino").eval()
    processor = AutoImageProcessor.from_pretrained(models / "dino")
    data = edits(4)

    def features(images):
        with torch.no_grad():
            out = model(**processor(images=images, return_tensors="pt"))
        assert torch.equal(out.pooler_output, out.last_hidden_state[:, 0])  # layer-normed
        return out.pooler_output.double()

    a, b = features(data.images), features(data.source_images)
    expected = ((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))).tolist()
    assert score(models, data) == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == 4 and all(-1 <= value <= 1 for value in expected)


def test_clip_is_the_cosine_of_the_projected_image_embeddings(models):
    from transformers import AutoProcessor, CLIPModel

    model = CLIPModel.from_pretrained(models / "clip").eval()
    processor = AutoProcessor.from_pretrained(models / "clip")
    data = edits(2)
    with torch.no_grad():
        a, b = (
            model.get_image_features(
                **processor(images=images, return_tensors="pt")
            ).pooler_output.double()
            for images in (data.images, data.source_images)
        )
    expected = ((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))).tolist()
    assert score(models, data, "clip") == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("backbone", ["dino", "clip"])
def test_an_unchanged_image_scores_1_and_batches_change_nothing(models, backbone):
    data = edits(5)
    same = RewardBatch(data.images, source_images=list(data.images))
    assert score(models, same, backbone) == pytest.approx([1.0] * 5, abs=1e-5)
    one_by_one = score(models, data, backbone, batch_size=1)
    assert score(models, data, backbone, batch_size=32) == pytest.approx(one_by_one, abs=1e-5)


def test_it_needs_source_images_and_records_what_scored(models):
    assert reward_needs("source_similarity") == {"images", "source_images"}
    with build_rewards({"source_similarity": 1.0}, options(models)) as rewards:
        info = rewards.info["source_similarity"]
        assert info == {"weight": 1.0, "backbone": "dino", "model": str(models / "dino"),
                        "dtype": "float32"}  # fmt: skip
        with pytest.raises(FlowGrpoError, match="'source_similarity' needs source_images"):
            rewards.score(RewardBatch([picture(0)]))


def test_the_wrong_kind_of_model_is_a_clear_error(models, tmp_path):
    key = r"\[reward.source_similarity\] model"
    with pytest.raises(FlowGrpoError, match=rf"{key} = .*clip'.* a 'clip' model, not 'dinov2'"):
        build_rewards(
            {"source_similarity": 1.0},
            RewardSection(device="cpu", source_similarity=SourceSimilaritySection(
                backbone="dino", model=str(models / "clip"))),
        )  # fmt: skip
    with pytest.raises(FlowGrpoError, match=rf"{key} = .*dino'.* a 'dinov2' model, not 'clip'"):
        build_rewards(
            {"source_similarity": 1.0},
            RewardSection(device="cpu", source_similarity=SourceSimilaritySection(
                backbone="clip", model=str(models / "dino"))),
        )  # fmt: skip
    (tmp_path / "empty").mkdir()
    empty = SourceSimilaritySection(model=str(tmp_path / "empty"))
    with pytest.raises(FlowGrpoError, match=rf"{key} = .*empty'.*no config.json"):
        build_rewards({"source_similarity": 1.0}, RewardSection(source_similarity=empty))
    with pytest.raises(FlowGrpoError, match=r"backbone` = 'siglip' is not one of 'dino'"):
        load_config(None, ["reward.source_similarity.backbone=siglip"])


def test_the_default_models_are_the_released_ones(monkeypatch, tmp_path):
    """Unset `model` means the backbone's released encoder, looked up on the hub (here offline,
    with an empty cache: an error naming the key and the id)."""
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    for backbone, model in [("dino", "facebook/dinov2-base"),
                            ("clip", "openai/clip-vit-large-patch14")]:  # fmt: skip
        table = SourceSimilaritySection(backbone=backbone)
        with pytest.raises(FlowGrpoError, match=rf"source_similarity\] model = '{model}'"):
            build_rewards({"source_similarity": 1.0}, RewardSection(source_similarity=table))


def test_the_table_counts_in_the_hash_only_when_weighted():
    scores_hash = STAGE_SECTIONS["scores"]
    plain = load_config(None)
    assert config_hash(plain, scores_hash) == config_hash(
        load_config(None, ["reward.source_similarity.backbone=clip"]), scores_hash
    )
    weighted = ["reward.weights={source_similarity = 1.0}"]
    assert config_hash(load_config(None, weighted), scores_hash) != config_hash(
        load_config(None, [*weighted, "reward.source_similarity.backbone=clip"]), scores_hash
    )


def test_flowgrpo_reward_takes_source_images(models, tmp_path):
    """`--source` once for all images or once per image, read as prepare reads them."""
    data = edits(2)
    for index, image in enumerate(data.images):
        image.save(tmp_path / f"r{index}.png")
    data.source_images[0].save(tmp_path / "s.png")
    picture(7, (40, 40)).save(tmp_path / "t.png")
    model = f'reward.source_similarity.model="{models / "dino"}"'
    base = ["reward", "--reward", "source_similarity", "--set", 'reward.device="cpu"',
            "--set", model, "--prompt", "edit"]  # fmt: skip
    runner = CliRunner()
    result = runner.invoke(app, [*base, "--source", str(tmp_path / "s.png"),
                                 str(tmp_path / "r0.png"), str(tmp_path / "r1.png")])  # fmt: skip
    assert result.exit_code == 0, result.output
    shared = RewardBatch(data.images, source_images=[data.source_images[0]] * 2)
    for value in score(models, shared):
        assert f"{value:.4f}" in result.output
    two = [str(tmp_path / "s.png"), str(tmp_path / "t.png")]
    result = runner.invoke(app, [*base, "--source", two[0], "--source", two[1],
                                 str(tmp_path / "r0.png"), str(tmp_path / "r1.png")])  # fmt: skip
    assert result.exit_code == 0, result.output
    own = RewardBatch(data.images, source_images=[data.source_images[0], picture(7, (40, 40))])
    assert f"{score(models, own)[1]:.4f}" in result.output
    for args, message in [
        ([*base, str(tmp_path / "r0.png")], "'source_similarity' needs source_images"),
        ([*base, "--source", two[0], "--source", two[1], "--source", two[0],
          str(tmp_path / "r0.png"), str(tmp_path / "r1.png")],
         "3 --source image(s) for 2 image(s)"),
        ([*base, "--source", str(tmp_path / "gone.png"), str(tmp_path / "r0.png")],
         f"--source: image {tmp_path / 'gone.png'} does not exist"),
    ]:  # fmt: skip
        result = runner.invoke(app, args)
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert message in " ".join(result.output.split()), result.output


def test_the_tiny_dinov2_folder_reads_like_the_released_one(models):
    """facebook/dinov2-base's files: a dinov2 config and BitImageProcessor settings (resize the
    shorter side, centre crop, ImageNet mean and std, bicubic)."""
    import json

    config = json.loads((models / "dino" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("dinov2", ["Dinov2Model"])
    processor = json.loads((models / "dino" / "preprocessor_config.json").read_text())
    assert processor["image_processor_type"] == "BitImageProcessor"
    assert (processor["do_resize"], processor["do_center_crop"], processor["resample"]) == (
        True, True, 3,
    )  # fmt: skip
    assert processor["image_mean"] == [0.485, 0.456, 0.406]
    assert processor["image_std"] == [0.229, 0.224, 0.225]

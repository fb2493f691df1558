"""The `hpsv2` reward on a tiny random model of open_clip's CLIP layout, saved as the released
checkpoints are (`torch.save({"state_dict": ...})`) and loaded through the same path: the
score from given embeddings and the transform against values worked out by hand, the
renamed weights against a reference forward written in open_clip's layout, the names and
shapes of the released ViT-H-14, and what a bad checkpoint says."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import OrderedDict

import pytest
import torch
from PIL import Image
from torch import nn

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models.tiny import build_tiny_clip, save_tiny_aesthetic_head
from flowgrpo_cli.rewards import RewardBatch, build_rewards
from flowgrpo_cli.rewards.hps import HpsModel, hps_pixels, open_clip_to_transformers
from flowgrpo_cli.rewards.registry import reward_needs
from flowgrpo_cli.store.config import HpsV2Section, RewardSection

EMBEDDING = 16  # the tiny CLIP's projection width


class Block(nn.Module):
    """open_clip's ResidualAttentionBlock: pre-LN attention and a GELU MLP, both residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            OrderedDict(
                c_fc=nn.Linear(width, 4 * width), gelu=nn.GELU(), c_proj=nn.Linear(4 * width, width)
            )
        )

    def forward(self, x, mask=None):  # [L, B, W], MultiheadAttention's sequence-first layout
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class Tower(nn.Module):
    def __init__(self, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.resblocks = nn.ModuleList(Block(width, heads) for _ in range(layers))

    def forward(self, x, mask=None):
        for block in self.resblocks:
            x = block(x, mask)
        return x


class OpenClip(nn.Module):
    """open_clip's CLIP (a ViT image tower) with its parameter names, written from its
    model.py / transformer.py; the reference the renamed weights are checked against."""

    def __init__(self, embed, image, patch, width, layers, heads, vocab, context, text_width,
                 text_layers, text_heads) -> None:  # fmt: skip
        super().__init__()
        self.visual = nn.Module()
        self.visual.conv1 = nn.Conv2d(3, width, patch, stride=patch, bias=False)
        self.visual.class_embedding = nn.Parameter(torch.zeros(width))
        self.visual.positional_embedding = nn.Parameter(
            torch.zeros((image // patch) ** 2 + 1, width)
        )
        self.visual.ln_pre = nn.LayerNorm(width)
        self.visual.transformer = Tower(width, layers, heads)
        self.visual.ln_post = nn.LayerNorm(width)
        self.visual.proj = nn.Parameter(torch.zeros(width, embed))
        self.token_embedding = nn.Embedding(vocab, text_width)
        self.positional_embedding = nn.Parameter(torch.zeros(context, text_width))
        self.transformer = Tower(text_width, text_layers, text_heads)
        self.ln_final = nn.LayerNorm(text_width)
        self.text_projection = nn.Parameter(torch.zeros(text_width, embed))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_image(self, pixels):
        v = self.visual
        x = v.conv1(pixels).flatten(2).transpose(1, 2)  # [B, patches, W]
        x = torch.cat([v.class_embedding.expand(len(x), 1, -1), x], dim=1) + v.positional_embedding
        x = v.transformer(v.ln_pre(x).transpose(0, 1)).transpose(0, 1)
        return v.ln_post(x[:, 0]) @ v.proj  # the class token

    def encode_text(self, ids, eot_positions):
        """`ids` [B, 77]; open_clip pools at text.argmax(-1), the end-of-text token, which has
        the largest id of its vocabulary (not of the tiny one: its position is given)."""
        length = ids.shape[1]
        causal = torch.full((length, length), float("-inf")).triu(1)
        x = self.token_embedding(ids) + self.positional_embedding
        x = self.ln_final(self.transformer(x.transpose(0, 1), causal).transpose(0, 1))
        return x[torch.arange(len(x)), eot_positions] @ self.text_projection


def tiny_open_clip(vocab: int, seed: int) -> OpenClip:
    """The tiny CLIP's shapes (build_tiny_clip), every parameter random: the layer norms too,
    so that a weight and a bias swapped or misplaced changes the embeddings."""
    model = OpenClip(EMBEDDING, 32, 8, 32, 2, 4, vocab, 77, 32, 2, 4)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("hps")
    build_tiny_clip(root / "base", projection_dim=EMBEDDING)
    # open_clip's MLPs are 4 x the width wide (the tiny CLIP's 2 x): a base of its shapes.
    config = json.loads((root / "base" / "config.json").read_text())
    for tower in ("text_config", "vision_config"):
        config[tower]["intermediate_size"] = 4 * config[tower]["hidden_size"]
    (root / "base" / "config.json").write_text(json.dumps(config))
    vocab = len(AutoTokenizer.from_pretrained(root / "base"))
    (root / "hps").mkdir()
    for seed, name in ((1, "HPS_v2_compressed.pt"), (2, "HPS_v2.1_compressed.pt")):
        torch.save({"state_dict": tiny_open_clip(vocab, seed).state_dict()}, root / "hps" / name)
    return root


def options(models, **changes) -> RewardSection:
    paths = {"checkpoint": str(models / "hps"), "base": str(models / "base")}
    table = HpsV2Section(**{**paths, **changes})
    return RewardSection(device="cpu", hpsv2=table)


def batch(count: int = 3) -> RewardBatch:
    generator = torch.Generator().manual_seed(3)
    sizes = [(48, 32), (32, 32), (20, 40), (64, 64)]
    images = [
        Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=generator).byte().numpy())
        for w, h in sizes[:count]
    ]
    prompts = ["a cat on a mat", "x", "a very long prompt " * 20, "dog"][:count]
    return RewardBatch(images, prompts)


def test_the_score_is_the_cosine_without_the_logit_scale(models, monkeypatch):
    # Image i and prompt i embed to the given unit vectors:
    #   (0.6, 0.8) . (0.8, 0.6) = 0.48 + 0.48 = 0.96;  (1, 0) . (-1, 0) = -1;
    #   (0, 1) . (0.6, 0.8) = 0.8
    images = torch.tensor([[0.6, 0.8], [1.0, 0.0], [0.0, 1.0]])
    texts = torch.tensor([[0.8, 0.6], [-1.0, 0.0], [0.6, 0.8]])
    monkeypatch.setattr(HpsModel, "image_embeddings", lambda self, _: images)
    monkeypatch.setattr(HpsModel, "text_embeddings", lambda self, _: texts)
    with build_rewards({"hpsv2": 1.0}, options(models)) as rewards:
        with torch.no_grad():  # HPSv2's scorer ignores it: a scale of 52 changes nothing
            rewards._rewards[0].clip.model.logit_scale.fill_(math.log(52.0))
        got = rewards.score(batch(3)).columns["hpsv2"]
    assert got == pytest.approx([0.96, -1.0, 0.8], abs=1e-6)


MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def test_the_transform_resizes_the_longer_side_pads_and_normalises():
    # 8 wide x 4 high, every pixel (255, 0, 51) = (1, 0, 0.2) in [0, 1]; to size 4: scale
    # 4 / 8 = 0.5, so 4 wide x 2 high (a uniform image stays uniform), then 4 - 2 = 2 rows of
    # zeros, 1 above and 1 below. Normalised:
    #   red   (1 - 0.48145466) / 0.26862954 = 0.51854534 / 0.26862954 =  1.93034
    #   green (0 - 0.4578275) / 0.26130258                          = -1.75210
    #   blue  (0.2 - 0.40821073) / 0.27577711 = -0.20821073 / 0.27577711 = -0.75499
    #   padding, (0 - mean) / std: -1.79228, -1.75210, -1.48021
    wide = Image.new("RGB", (8, 4), (255, 0, 51))
    x = hps_pixels(wide, 4)
    image, pad = (
        torch.tensor([1.93034, -1.75210, -0.75499]),
        torch.tensor([-1.79228, -1.75210, -1.48021]),
    )
    assert x.shape == (3, 4, 4) and x.dtype == torch.float32
    for row, expected in ((0, pad), (1, image), (2, image), (3, pad)):
        assert torch.allclose(x[:, row], expected[:, None].expand(3, 4), atol=1e-4), row
    # 2 wide x 8 high: 1 wide x 4 high, then 4 - 1 = 3 columns: 3 // 2 = 1 left, 2 right.
    tall = hps_pixels(Image.new("RGB", (2, 8), (255, 0, 51)), 4)
    for column, expected in ((0, pad), (1, image), (2, pad), (3, pad)):
        assert torch.allclose(tall[:, :, column], expected[:, None].expand(3, 4), atol=1e-4)
    # Already 4 x 4: not resized; pixel 128 -> 128 / 255 = 0.50196, red (0.50196 - 0.48145) /
    # 0.26863 = 0.07634.
    square = hps_pixels(Image.new("RGB", (4, 4), (128, 128, 128)), 4)
    assert square[0] == pytest.approx(torch.full((4, 4), 0.07634), abs=1e-4)


def test_the_released_vit_h_14_maps_onto_transformers_names_and_shapes():
    """open_clip's ViT-H-14 (model_configs/ViT-H-14.json: embed 1024; vision 32 layers of
    width 1280, 16 heads of 80, patch 14 at 224 px; text 24 layers of width 1024, 16 heads)
    on the meta device, renamed, against transformers' CLIPModel of laion's CLIP-ViT-H-14
    config: the same keys, each of the same shape."""
    from transformers import CLIPConfig, CLIPModel

    from benchmarks.reward_memory import CLIP_H14

    with torch.device("meta"):
        released = OpenClip(1024, 224, 14, 1280, 32, 16, 49408, 77, 1024, 24, 16)
        target = CLIPModel(CLIPConfig(**CLIP_H14))
    state = released.state_dict()
    # Names and shapes from open_clip's code: packed q, k, v 3 x 1280 = 3840 rows;
    # (224 / 14)^2 + 1 = 16^2 + 1 = 257 positions (the class token's included).
    assert state["visual.transformer.resblocks.31.attn.in_proj_weight"].shape == (3840, 1280)
    assert state["visual.positional_embedding"].shape == (257, 1280)
    assert state["visual.proj"].shape == (1280, 1024)
    assert state["transformer.resblocks.23.mlp.c_fc.weight"].shape == (4096, 1024)
    converted, unknown = open_clip_to_transformers(state)
    assert unknown == []
    expected = {key: tuple(value.shape) for key, value in target.state_dict().items()}
    assert {key: tuple(value.shape) for key, value in converted.items()} == expected


def test_scores_are_the_open_clip_forward_of_the_checkpoint(models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models / "base")
    state = torch.load(models / "hps" / "HPS_v2.1_compressed.pt")["state_dict"]
    reference = tiny_open_clip(len(tokenizer), 0)
    reference.load_state_dict(state)
    data = batch(4)
    ids = tokenizer(data.prompts, padding="max_length", truncation=True, max_length=77,
                    return_tensors="pt")["input_ids"]  # fmt: skip
    eot = (ids == tokenizer.eos_token_id).int().argmax(-1)  # the first end-of-text token
    with torch.no_grad():
        image = reference.encode_image(torch.stack([hps_pixels(i, 32) for i in data.images]))
        text = reference.encode_text(ids, eot)
    expected = torch.nn.functional.cosine_similarity(image, text).tolist()
    with build_rewards({"hpsv2": 1.0}, options(models)) as rewards:
        got = rewards.score(data).columns["hpsv2"]
        info = rewards.info["hpsv2"]
    assert got == pytest.approx(expected, abs=1e-5)
    assert max(abs(value) for value in got) > 0.05  # not all ~0: the test can tell them apart
    assert info == {
        "weight": 1.0, "checkpoint": str(models / "hps" / "HPS_v2.1_compressed.pt"),
        "version": "v2.1", "base": str(models / "base"), "dtype": "float32",
    }  # fmt: skip


def test_the_version_picks_the_file_and_batches_agree(models):
    def scores(section: RewardSection) -> list[float]:
        with build_rewards({"hpsv2": 1.0}, section) as rewards:
            return rewards.score(batch(4)).columns["hpsv2"]

    v21 = scores(options(models))
    assert scores(dataclasses.replace(options(models), batch_size=1)) == pytest.approx(
        v21, abs=1e-5
    )
    assert scores(options(models, version="v2")) != pytest.approx(v21, abs=1e-3)  # other seed
    with build_rewards({"hpsv2": 1.0}, options(models, version="v2")) as rewards:
        assert rewards.info["hpsv2"]["checkpoint"].endswith("/HPS_v2_compressed.pt")


def test_html_entities_in_prompts_are_unescaped_as_open_clip_does(models):
    data = batch(2)
    escaped = RewardBatch(data.images, ["Tom &amp; Jerry", "a &amp;lt;b&amp;gt; tag"])
    plain = RewardBatch(data.images, ["Tom & Jerry", "a <b> tag"])  # unescaped twice
    with build_rewards({"hpsv2": 1.0}, options(models)) as rewards:
        got, expected = (rewards.score(b).columns["hpsv2"] for b in (escaped, plain))
        literal = rewards.score(RewardBatch(data.images, ["Tom and Jerry", "a tag"]))
    assert got == pytest.approx(expected, abs=1e-6)
    assert literal.columns["hpsv2"] != pytest.approx(expected, abs=1e-4)  # the text counts


def test_needs_are_known_without_loading_a_model():
    assert reward_needs("hpsv2") == {"images", "prompts"}


def test_bad_checkpoints_are_clear_errors(models, tmp_path):
    def build(checkpoint) -> None:
        build_rewards({"hpsv2": 1.0}, options(models, checkpoint=str(checkpoint)))

    (tmp_path / "empty").mkdir()
    with pytest.raises(FlowGrpoError, match=r"\[reward.hpsv2\] checkpoint = .*empty'.*"
                       r"no HPS_v2.1_compressed.pt"):  # fmt: skip
        build(tmp_path / "empty")
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint at all")
    with pytest.raises(FlowGrpoError, match=r"corrupt.pt cannot be read as a torch checkpoint"):
        build(corrupt)
    head = save_tiny_aesthetic_head(tmp_path / "head.pt", EMBEDDING)
    with pytest.raises(FlowGrpoError, match=r"head.pt is not an open_clip CLIP state dict: "
                       r"10 keys \(layers.0.weight, .*\) not expected"):  # fmt: skip
        build(head)
    wide = tmp_path / "wide.pt"
    model = OpenClip(EMBEDDING, 32, 8, 48, 2, 4, 514, 77, 32, 2, 4)  # vision width 48, not 32
    torch.save({"state_dict": model.state_dict()}, wide)
    with pytest.raises(FlowGrpoError, match=r"wide.pt does not fit the base's architecture"):
        build(wide)
    torch.save({"state_dict": {"visual.proj": "text"}}, tmp_path / "text.pt")
    with pytest.raises(FlowGrpoError, match=r"holds no state dict of tensors"):
        build(tmp_path / "text.pt")
    with pytest.raises(FlowGrpoError, match=r"`reward.hpsv2.version` = 'v3' is not one of"):
        HpsV2Section(version="v3")


def test_flowgrpo_reward_scores_with_hpsv2_from_a_config(models, tmp_path):
    from typer.testing import CliRunner

    from flowgrpo_cli.cli import app

    image = tmp_path / "a.png"
    data = batch(1)
    data.images[0].save(image)
    config = tmp_path / "rewards.toml"
    config.write_text(
        f'[reward]\ndevice = "cpu"\nweights = {{ hpsv2 = 1.0 }}\n'
        f'[reward.hpsv2]\ncheckpoint = "{models}/hps"\nbase = "{models}/base"\n'
    )
    result = CliRunner().invoke(
        app, ["reward", "-c", str(config), "--prompt", data.prompts[0], str(image)]
    )
    assert result.exit_code == 0, result.output
    with build_rewards({"hpsv2": 1.0}, options(models)) as rewards:
        expected = rewards.score(data).columns["hpsv2"][0]
    assert f"{expected:.4f}" in result.output, result.output


def test_flowgrpo_plan_counts_the_hpsv2_model():
    """HPSv2's ViT-H-14 has the shapes of laion's CLIP-ViT-H-14: 986.1M parameters, 4 bytes
    each in float32 (the CPU's auto dtype)."""
    from pathlib import Path

    from typer.testing import CliRunner

    from flowgrpo_cli.cli import app

    example = Path(__file__).resolve().parents[1] / "examples" / "sd35m_ocr.toml"
    args = ["plan", "--config", str(example), "--json", "--set", "reward.dtype=float32",
            "--set", "reward.weights={ocr = 1.0, hpsv2 = 1.0}"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    items = dict(json.loads(result.output)["memory"]["score"]["items"])
    size = items["reward model hpsv2 (986M x float32)"]
    assert size == pytest.approx(4 * 986.1e6, rel=1e-3)


def test_hub_ids_are_read_at_their_commits_and_dtypes_apply(models, tmp_path, monkeypatch):
    import shutil

    commits = {"tiny-org/hps": "1" * 40, "tiny-org/base": "2" * 40}
    cache = tmp_path / "hub"
    for repo, folder in (("tiny-org/hps", "hps"), ("tiny-org/base", "base")):
        repo_dir = cache / f"models--{repo.replace('/', '--')}"
        shutil.copytree(models / folder, repo_dir / "snapshots" / commits[repo])
        (repo_dir / "refs").mkdir()
        (repo_dir / "refs" / "main").write_text(commits[repo])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    hub = RewardSection(
        device="cpu", dtype="bfloat16",
        hpsv2=HpsV2Section(checkpoint="tiny-org/hps", base="tiny-org/base"),
    )  # fmt: skip
    with build_rewards({"hpsv2": 1.0}, hub) as rewards:
        info = rewards.info["hpsv2"]
        assert rewards._rewards[0].clip.model.dtype == torch.bfloat16
        half = rewards.score(batch(4)).columns["hpsv2"]
    assert info["checkpoint"] == f"tiny-org/hps@{'1' * 40}/HPS_v2.1_compressed.pt"
    assert info["base"] == f"tiny-org/base@{'2' * 40}" and info["dtype"] == "bfloat16"
    with build_rewards({"hpsv2": 1.0}, options(models)) as rewards:
        full = rewards.score(batch(4)).columns["hpsv2"]
    # bfloat16 weights move the embeddings a little; the cosine is still taken in float32.
    assert half == pytest.approx(full, abs=0.05) and half != full

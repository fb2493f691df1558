"""Weights memory of the model rewards, counted from their released architectures.

    python -m benchmarks.reward_memory          # `just reward-memory`; a few seconds

Each reward's CLIP is built from the shapes of its released config.json on the meta device
(no weights are allocated or downloaded) and its parameters counted; the memory is that count
times the bytes per parameter of the dtype. Activations come on top: a forward pass of a
batch of 224 x 224 images adds a fraction of the weights per image, not measured here.
"""

from __future__ import annotations

# The released configs' shapes (config.json of each hub repository).
CLIP_L14 = {  # openai/clip-vit-large-patch14
    "text_config": {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
                    "num_hidden_layers": 12, "vocab_size": 49408, "max_position_embeddings": 77},
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
                      "num_hidden_layers": 24, "image_size": 224, "patch_size": 14},
    "projection_dim": 768,
}  # fmt: skip
# laion/CLIP-ViT-H-14-laion2B-s32B-b79K, yuvalkirstain/PickScore_v1, and HPSv2's open_clip
# ViT-H-14 (the same shapes: model_configs/ViT-H-14.json)
CLIP_H14 = {
    "text_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
                    "num_hidden_layers": 24, "vocab_size": 49408, "max_position_embeddings": 77},
    "vision_config": {"hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 16,
                      "num_hidden_layers": 32, "image_size": 224, "patch_size": 14},
    "projection_dim": 1024,
}  # fmt: skip


# facebook/mask2former-swin-small-coco-instance, GenEval's detector (its Swin-S backbone and
# the Mask2Former head at transformers' defaults: 100 queries, 256 wide, 6 + 10 layers)
SWIN_S = {"embed_dim": 96, "depths": [2, 2, 18, 2], "num_heads": [3, 6, 12, 24], "window_size": 7,
          "out_features": ["stage1", "stage2", "stage3", "stage4"]}  # fmt: skip


def mask2former_parameters(backbone: dict, labels: int = 80) -> int:
    import torch
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    config = Mask2FormerConfig(backbone_config=SwinConfig(**backbone), num_labels=labels)
    with torch.device("meta"):
        model = Mask2FormerForUniversalSegmentation(config)
    return sum(p.numel() for p in model.parameters())


def clip_parameters(shapes: dict) -> int:
    import torch
    from transformers import CLIPConfig, CLIPModel

    with torch.device("meta"):
        model = CLIPModel(CLIPConfig(**shapes))
    return sum(p.numel() for p in model.parameters())


def head_parameters(embedding_dim: int) -> int:
    from flowgrpo_cli.rewards.clip import aesthetic_head

    return sum(p.numel() for p in aesthetic_head(embedding_dim).parameters())


def main() -> None:
    from flowgrpo_cli.reporting.render import format_bytes

    rows = {
        "pickscore (PickScore_v1, CLIP ViT-H/14)": clip_parameters(CLIP_H14),
        "clipscore (CLIP ViT-L/14)": clip_parameters(CLIP_L14),
        "aesthetic (CLIP ViT-L/14 + MLP head)": clip_parameters(CLIP_L14) + head_parameters(768),
        "hpsv2 (HPS v2 / v2.1, open_clip ViT-H/14)": clip_parameters(CLIP_H14),
        "geneval (Mask2Former Swin-S COCO + CLIP ViT-L/14 for colours)": (
            mask2former_parameters(SWIN_S) + clip_parameters(CLIP_L14)
        ),
    }
    print("| reward | parameters | weights, float16 | weights, float32 |")
    print("|---|---|---|---|")
    for name, count in rows.items():
        print(
            f"| {name} | {count / 1e6:.1f}M | {format_bytes(2 * count)} | "
            f"{format_bytes(4 * count)} |"
        )


if __name__ == "__main__":
    main()

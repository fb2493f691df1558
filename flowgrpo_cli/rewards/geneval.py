"""`geneval`: does the image show what its GenEval record asks for (objects, counts, colours,
positions)? Ghosh et al.'s GenEval benchmark as a reward, as flow_grpo trains on it.

Per image, as GenEval's evaluate_images.py does it:
1. Detect: a Mask2Former COCO instance-segmentation model (GenEval uses mmdet's Swin-S; here
   transformers' Mask2FormerForUniversalSegmentation and its image processor's
   post_process_instance_segmentation, which scores a (query, class) pair as mmdet does: class
   probability x mean mask probability inside the mask). Every detection is kept, with its
   score; GenEval's thresholds are the rules' business. Its box is the mask's bounding box,
   (x_min, y_min, x_max + 1, y_max + 1) in pixels, as mmdet derives it.
2. Colour, for each detection GenEval's filter keeps (the rules' kept_detections) of a class
   the record asks a colour of: the object is pasted on a #999 grey background through its
   mask, cropped to its box, and CLIP ViT-L/14 picks one of GenEval's colours zero-shot,
   each colour's text embedding being the normalised mean of three prompts
   ("a photo of a {colour} {object}", "a photo of a {colour}-colored {object}",
   "a photo of a {colour} object").
3. Judge: rewards/geneval_rules.py's score_record gives `correct`, `strict`, `partial` and a
   reason; `[reward.geneval] score` says which is the reward.

The record comes in each image's metadata under GENEVAL_KEY (the score stage looks it up by
the sample's prompt; a served reward gets it from the request). A record the rules refuse
fails that image with their message, which names the key.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from PIL import Image

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import GENEVAL_KEY, ImageScore, Need, RewardBatch, RewardOutput
from flowgrpo_cli.rewards.clip import ClipModel
from flowgrpo_cli.rewards.geneval_rules import (
    COCO_CLASSES,
    COLOURS,
    Detection,
    colour_requests,
    kept_detections,
    score_record,
)
from flowgrpo_cli.rewards.hub import load_pretrained, resolve_folder
from flowgrpo_cli.store.config import RewardSection

if TYPE_CHECKING:
    import torch

KEY = "reward.geneval"
CROP_BACKGROUND = "#999999"  # GenEval's grey behind a masked object
COLOUR_TEMPLATES = (
    "a photo of a {colour} {name}",
    "a photo of a {colour}-colored {name}",
    "a photo of a {colour} object",
)
DETAILS = ("correct", "strict", "partial", "reason")

Found = dict[str, list[Detection]]  # GenEval class name -> detections, best score first


class GenEvalReward:
    name = "geneval"
    needs: frozenset[Need] = frozenset({"images", "geneval"})
    parallel_safe = True  # torch releases the GIL in its kernels

    def __init__(self, options: RewardSection) -> None:
        table = options.geneval
        self.score_name = table.score
        clip = (table.clip, table.clip_revision)
        self.clip = ClipModel(clip, clip, options, KEY, field="clip")
        # imported once loading is quiet (ClipModel): the processor's import warns otherwise
        import torch
        from transformers import (
            AutoConfig,
            AutoImageProcessor,
            Mask2FormerForUniversalSegmentation,
        )

        self.batch_size = options.batch_size
        self.detector_source = resolve_folder(
            table.detector, table.detector_revision, "preprocessor_config.json",
            f"[{KEY}] detector",
        )  # fmt: skip
        # `reward.dtype = "auto"` keeps the detector in float32, as GenEval runs it: its
        # scores meet thresholds (0.3, 0.9) that float16 rounding could move them across.
        self.detector_dtype = torch.float32 if options.dtype == "auto" else self.clip.dtype
        _check_detector(load_pretrained(AutoConfig, self.detector_source), table.detector)
        self.detector = load_pretrained(
            Mask2FormerForUniversalSegmentation, self.detector_source, dtype=self.detector_dtype
        )
        self.detector.to(self.clip.device).eval().requires_grad_(False)
        self.processor = load_pretrained(AutoImageProcessor, self.detector_source)
        self._classifiers: dict[str, torch.Tensor] = {}  # class name -> [colours, D]

    def score(self, batch: RewardBatch) -> RewardOutput:
        assert batch.metadata is not None  # RewardSet checks `needs`
        records = [meta[GENEVAL_KEY] for meta in batch.metadata]
        scores: list[ImageScore | None] = [None] * len(batch)
        for index, record in enumerate(records):
            try:  # a served request's record is anyone's: checked here, image by image
                colour_requests(record)
            except FlowGrpoError as err:
                scores[index] = ImageScore.failed(str(err))
        valid = [index for index, score in enumerate(scores) if score is None]
        found = self.detect([batch.images[i] for i in valid], [records[i] for i in valid])
        details: dict[str, list[Any]] = {key: [None] * len(batch) for key in DETAILS}
        for index, detections in zip(valid, found, strict=True):
            result = score_record(records[index], detections)
            values = {"correct": float(result.correct), "strict": result.strict,
                      "partial": result.partial}  # fmt: skip
            scores[index] = ImageScore.checked(values[self.score_name])
            for key in DETAILS:
                details[key][index] = getattr(result, key)
        return RewardOutput([score for score in scores if score is not None], details)

    def detect(
        self, images: Sequence[Image.Image], records: Sequence[dict[str, Any]]
    ) -> list[Found]:
        """Per image: COCO class name -> its detections, best first. Those the rules will
        colour-check for the image's record (`colour_requests`, kept by GenEval's filter)
        carry their mask and CLIP's colour."""
        found: list[Found] = []
        for start in range(0, len(images), self.batch_size):
            chunk = [image.convert("RGB") for image in images[start : start + self.batch_size]]
            for image, result, record in zip(
                chunk, self._segment(chunk), records[start : start + len(chunk)], strict=True
            ):
                found.append(self._detections(image, result, record))
        return found

    def _segment(self, images: list[Image.Image]) -> list[dict[str, Any]]:
        """post_process_instance_segmentation's results: every (query, class) pair the model
        ranks in its top `num_queries`, with a non-empty mask, as binary masks at image size."""
        import torch

        inputs = self.processor(images=images, return_tensors="pt")
        with torch.inference_mode():
            out = self.detector(
                pixel_values=inputs["pixel_values"].to(self.clip.device, self.detector_dtype),
                pixel_mask=inputs["pixel_mask"].to(self.clip.device),
            )
        logits = SimpleNamespace(  # the post-processing's softmax and sigmoid in float32
            class_queries_logits=out.class_queries_logits.float(),
            masks_queries_logits=out.masks_queries_logits.float(),
        )
        return self.processor.post_process_instance_segmentation(
            logits,
            threshold=0.0,  # every detection: GenEval's thresholds are the rules'
            target_sizes=[(image.height, image.width) for image in images],
            return_binary_maps=True,
        )

    def _detections(self, image: Image.Image, result: dict[str, Any], record: dict) -> Found:
        segments = result["segments_info"]
        masks = result["segmentation"].bool().cpu().numpy() if segments else None
        colour_classes = colour_requests(record)
        found: Found = {}
        for index, segment in enumerate(segments):
            name = COCO_CLASSES[segment["label_id"]]
            assert masks is not None
            mask = masks[index]
            keep_mask = name in colour_classes  # only a colour crop reads it
            found.setdefault(name, []).append(
                Detection(float(segment["score"]), _box(mask), mask if keep_mask else None)
            )
        for detections in found.values():
            detections.sort(key=lambda detection: -detection.score)
        kept = kept_detections(record, found)  # the same objects, filtered
        for name in colour_classes & kept.keys():
            recoloured = self._coloured(image, name, kept[name])
            coloured = dict(zip(map(id, kept[name]), recoloured, strict=True))
            found[name] = [coloured.get(id(detection), detection) for detection in found[name]]
        return found

    def _coloured(
        self, image: Image.Image, name: str, detections: list[Detection]
    ) -> list[Detection]:
        """The detections with `colour` set: CLIP's zero-shot choice among COLOURS for each
        object's masked crop."""
        import dataclasses

        background = Image.new("RGB", image.size, CROP_BACKGROUND)
        crops = []
        for detection in detections:
            assert detection.mask is not None
            alpha = Image.fromarray(detection.mask)
            crops.append(Image.composite(image, background, alpha).crop(detection.box))
        logits = self.clip.image_embeddings(crops) @ self._classifier(name).T  # [N, colours]
        return [
            dataclasses.replace(detection, colour=COLOURS[int(best)])
            for detection, best in zip(detections, logits.argmax(dim=-1).tolist(), strict=True)
        ]

    def _classifier(self, name: str) -> torch.Tensor:
        """[colours, D]: per colour, the normalised mean of its prompts' unit embeddings."""
        if name not in self._classifiers:
            texts = [
                template.format(colour=colour, name=name)
                for colour in COLOURS
                for template in COLOUR_TEMPLATES
            ]
            embeddings = self.clip.text_embeddings(texts)  # [colours * templates, D]
            mean = embeddings.reshape(len(COLOURS), len(COLOUR_TEMPLATES), -1).mean(dim=1)
            self._classifiers[name] = mean / mean.norm(dim=-1, keepdim=True)
        return self._classifiers[name]

    @property
    def info(self) -> dict[str, str]:
        clip = self.clip.info()
        return {
            "detector": self.detector_source.record,
            "detector_dtype": str(self.detector_dtype).removeprefix("torch."),
            "clip": clip["model"],
            "clip_dtype": clip["dtype"],
            "score": self.score_name,
        }

    def close(self) -> None:
        del self.detector
        self.clip.close()


def _check_detector(config: Any, given: str) -> None:
    """A Mask2Former with COCO's 80 classes, in their order (label i is COCO_CLASSES[i])."""
    where = f"[{KEY}] detector = {given!r}"
    if config.model_type != "mask2former":
        raise FlowGrpoError(f"{where}: a {config.model_type} model, not a Mask2Former")
    if len(config.id2label) != len(COCO_CLASSES):
        raise FlowGrpoError(
            f"{where}: {len(config.id2label)} classes, not COCO's {len(COCO_CLASSES)}: GenEval "
            "needs a COCO instance-segmentation model"
        )


def _box(mask: Any) -> tuple[float, float, float, float]:
    """The bounding box of a non-empty boolean mask [H, W]: (x_min, y_min, x_max + 1,
    y_max + 1), mmdet's mask2bbox."""
    columns = mask.any(axis=0).nonzero()[0]
    rows = mask.any(axis=1).nonzero()[0]
    return (float(columns[0]), float(rows[0]), float(columns[-1] + 1), float(rows[-1] + 1))


def build_geneval(section: RewardSection) -> GenEvalReward:
    return GenEvalReward(section)

"""Source images of an editing data set: read from a prompt file, checked, kept as PNG.

`flowgrpo prepare` reads each row's image (a file the row names, or the bytes a parquet cell
holds), refuses one that is missing, unreadable or larger than `data.max_image_pixels`, turns
it upright (its EXIF orientation, as diffusers' `load_image` does) and RGB, and stores it in
the prompt table as PNG (`source_image`) with the SHA-256 of the bytes it read
(`source_sha256`: which input file it was). Rollout, score and evaluate decode that PNG.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flowgrpo_cli.errors import FlowGrpoError

if TYPE_CHECKING:
    from PIL import Image


@dataclass(frozen=True)
class SourceImage:
    png: bytes  # RGB, upright, PNG: what the prompt table stores
    sha256: str  # hex digest of the bytes read (the image file, or the parquet cell)


def load_source_image(
    reference: Path | bytes, max_pixels: int, size: Sequence[int] = ()
) -> SourceImage:
    """The image a prompt row names (a file) or holds (bytes), checked and made PNG, resized to
    `size` ([width, height]; empty: as it is) with PIL's default filter (bicubic), as
    flow_grpo's edit trainers resize theirs; a FlowGrpoError that says what is wrong with it
    (the caller adds the row)."""
    import hashlib

    from PIL import Image, ImageOps, UnidentifiedImageError

    what = f"image {reference}" if isinstance(reference, Path) else "the image bytes"
    if isinstance(reference, Path):
        if not reference.is_file():
            state = "is a folder, not a file" if reference.is_dir() else "does not exist"
            raise FlowGrpoError(f"image {reference} {state}")
        data = reference.read_bytes()
    else:
        data = reference
    limit = f"data.max_image_pixels = {max_pixels:,}"
    with warnings.catch_warnings():  # data.max_image_pixels is the limit, not Pillow's
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise FlowGrpoError(
                        f"{what} is {width} x {height} = {width * height:,} pixels, over {limit}"
                    )
                upright = ImageOps.exif_transpose(image).convert("RGB")  # decodes every pixel
        except Image.DecompressionBombError as err:
            raise FlowGrpoError(f"{what} is too large to open ({err}); {limit}") from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
            raise FlowGrpoError(f"{what} cannot be read as an image ({err})") from None
    if size:
        upright = upright.resize((size[0], size[1]))
    buffer = io.BytesIO()
    upright.save(buffer, format="PNG")
    return SourceImage(buffer.getvalue(), hashlib.sha256(data).hexdigest())


def decode_source_image(png: bytes) -> Image.Image:
    """A stored source image (PNG bytes of a prompt table) as an RGB PIL image."""
    from PIL import Image

    return Image.open(io.BytesIO(png)).convert("RGB")


def decode_batch(pngs: Sequence[bytes | None]) -> list[Image.Image] | None:
    """The stored source images of a batch's prompts (one entry per image), decoded once per
    distinct image; None for a batch without any (a text-to-image data set)."""
    present = [png for png in pngs if png is not None]
    if not present:
        return None
    if len(present) < len(pngs):  # prepare refuses such a data set
        raise ValueError("a batch mixes prompts with and without source images")
    decoded = {png: decode_source_image(png) for png in set(present)}
    return [decoded[png] for png in present]

"""DeepSeek-V4.1's image processor: a picture -> the ViT's patches, as the release computes them.

Legend: p = patch side (14), r = the aligner's downsample (3); a ViT grid of n_vit_h x n_vit_w
patches becomes an LLM grid of ceil(n_vit_h / r) x ceil(n_vit_w / r) image cells.

The steps (DeepSeek-V4.1's inference/image_processor.py; the release's vision_config sizes them):
1. Plan (`plan_grid`, integers and floats only): cap the width at `max_wh_ratio` x the height
   when set; an image of fewer than `min_pixels` pixels is scaled up by sqrt(min_pixels / area),
   each side truncated; each side is rounded up to a multiple of p. When the LLM span of that grid,
   n_llm_h (n_llm_w + 1) + 2 positions, exceeds `max_image_tokens`, the size shrinks to the
   largest aspect-keeping one whose span fits (`_fitted`: sides floored to multiples of p; one
   column for a very tall image, one row for a very wide one).
2. Pixels: RGB (alpha dropped); with `max_wh_ratio` set and the width at least that ratio times
   the height, a plain resize to the plan (aspect not kept); otherwise Pillow's `ImageOps.pad`:
   fit inside the plan by a BICUBIC resize (no resampling when already that size) and centre on a
   (127, 127, 127) canvas. Pillow's BICUBIC is its own antialiased filter, so Pillow does it.
3. Values: uint8 / 255, then (x - 0.5) / 0.5 in float32 ([-1, 1]), rounded to bf16.
4. Patches: [3, H, W] -> [n_vit_h * n_vit_w, 3, p, p], row-major over the grid, each patch
   channel-major (what the ViT's patch embedding flattens).

`image_patches` checks the golden patches of DeepSeek's code bit for bit
(tests/unit/data/test_images.py).
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

from primus_v4.errors import DataError

GREY = (127, 127, 127)
# token types of an image span (DeepSeek-V4.1: text is -1)
TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3


@dataclass(frozen=True, kw_only=True)
class ImageGrid:
    """The image sizes of a release's `vision_config` (its field names)."""

    patch_size: int = 14
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None

    def __post_init__(self) -> None:
        for name in ("patch_size", "downsample_ratio", "min_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"vision_config.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_image_tokens < 5:  # one cell: start, cell, new line, end
            raise ValueError(f"vision_config.max_image_tokens must be >= 5, got "
                             f"{self.max_image_tokens}")  # fmt: skip
        if self.max_wh_ratio is not None and self.max_wh_ratio <= 0:
            raise ValueError(f"vision_config.max_wh_ratio must be > 0, got {self.max_wh_ratio}")

    @classmethod
    def of(cls, config: Any) -> ImageGrid:
        """From an `ImageGrid`, a `vision_config` mapping, or a model config holding one."""
        if isinstance(config, ImageGrid):
            return config
        vision = getattr(config, "vision_config", config)
        if isinstance(vision, dict) and isinstance(vision.get("vision_config"), dict):
            vision = vision["vision_config"]  # a release's whole config.json
        if not isinstance(vision, dict):
            vision = vars(vision)
        names = ("patch_size", "downsample_ratio", "max_image_tokens", "min_pixels",
                 "max_wh_ratio")  # fmt: skip
        return cls(**{n: vision[n] for n in names if n in vision})


@dataclass(frozen=True)
class GridPlan:
    """An image's plan: its LLM cell grid and the pixel size it is resized to."""

    llm_h: int
    llm_w: int
    height: int
    width: int

    def vit(self, patch: int) -> tuple[int, int]:
        return self.height // patch, self.width // patch

    @property
    def span(self) -> int:
        """Positions of the image in the token stream."""
        return span_length(self.llm_h, self.llm_w)


def span_length(llm_h: int, llm_w: int) -> int:
    return llm_h * (llm_w + 1) + 2


def span_types(llm_h: int, llm_w: int) -> list[int]:
    """The token types of an image span: start, each row's cells then a new line, end."""
    return [IMAGE_START, *([IMAGE] * llm_w + [IMAGE_NEW_LINE]) * llm_h, IMAGE_END]


def _cells(height: int, width: int, grid: ImageGrid) -> tuple[int, int]:
    p, r = grid.patch_size, grid.downsample_ratio
    return math.ceil((height // p) / r), math.ceil((width // p) / r)


def _fitted(height: float, width: float, grid: ImageGrid) -> tuple[int, int]:
    """The largest aspect-keeping (height, width), sides multiples of p, whose span fits."""
    p, n = grid.patch_size, grid.max_image_tokens
    cell = p * grid.downsample_ratio
    aspect = height / width
    # cells per row w with h = w * aspect: h (w + 1) + 2 <= n
    cols = math.sqrt((n - 2) / aspect + 0.25) - 0.5
    rows = cols * aspect
    if cols < 1.0:  # too tall for one cell per row: a single column
        return (n - 2) // 2 * cell, cell
    if rows < 1.0:  # too wide: a single row
        return cell, (n - 3) * cell
    scale = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_grid(width: int, height: int, config: Any) -> GridPlan:
    """The plan of an image of `width` x `height` pixels (step 1 of the module docstring)."""
    grid = ImageGrid.of(config)
    p = grid.patch_size
    if grid.max_wh_ratio is not None and width > height * grid.max_wh_ratio:
        width = height * grid.max_wh_ratio
    if 0 < width * height < grid.min_pixels:
        up = (grid.min_pixels / (width * height)) ** 0.5
        width, height = int(width * up), int(height * up)
    best_h, best_w = math.ceil(height / p) * p, math.ceil(width / p) * p
    llm_h, llm_w = _cells(best_h, best_w, grid)
    if span_length(llm_h, llm_w) > grid.max_image_tokens:
        best_h, best_w = _fitted(height, width, grid)
        llm_h, llm_w = _cells(best_h, best_w, grid)
    return GridPlan(llm_h=llm_h, llm_w=llm_w, height=best_h, width=best_w)


def open_image(image: Any, *, where: str = "") -> Any:
    """A PIL image in RGB from a PIL image, a path, or the file's bytes; a missing or unreadable
    file is a DataError naming it (and `where`, e.g. the row)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    name = "<bytes>" if isinstance(image, bytes | bytearray) else str(image)
    try:
        source = io.BytesIO(image) if isinstance(image, bytes | bytearray) else Path(image)
        with Image.open(source) as opened:
            return opened.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as exc:
        at = f" ({where})" if where else ""
        raise DataError(f"image {name}{at}: cannot read it as a picture: {exc}") from None


def image_patches(
    image: str | os.PathLike | bytes | Any, config: Any
) -> tuple[torch.Tensor, tuple[int, int]]:
    """(patches bf16 [h * w, 3, p, p], (h, w) the ViT grid) of `image` (a path, bytes or PIL
    image) for the release `config` (its vision_config, or an `ImageGrid`)."""
    import torch  # here: packing reads images without torch
    from PIL import ImageOps

    grid = ImageGrid.of(config)
    picture = open_image(image)
    plan = plan_grid(picture.width, picture.height, grid)
    p = grid.patch_size
    size = (plan.width, plan.height)
    ratio = grid.max_wh_ratio
    if ratio is not None and picture.width >= ratio * picture.height:
        picture = picture.resize(size)
    else:
        picture = ImageOps.pad(picture, size, color=GREY)
    x = torch.from_numpy(np.asarray(picture, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)
    h, w = plan.vit(p)
    patches = x.reshape(3, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, 3, p, p)
    return patches.contiguous(), (h, w)

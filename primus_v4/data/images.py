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

Pictures are read as data only: a file is opened by Pillow's PNG, JPEG, WebP, GIF (the first
frame), BMP or TIFF reader (`READ_FORMATS`), decoders of Pillow's own or of its C libraries, and
no other Pillow plugin is consulted. Any other file (EPS, PostScript, PDF, or a format whose
plugin would start a program such as Ghostscript) is an `ImageFormatError`. A picture stored with
more than 8 bits per channel (16-bit PNG or TIFF, Pillow's `I;16`, `I` and `F` modes) is converted
as DeepSeek's processor converts it (`convert("RGB")`: 16-bit and float grey clip toward white);
`read_picture` reports its depth so that packing can count it, warn, or refuse it under strict.
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

from primus_v4.errors import ConfigError, DataError

GREY = (127, 127, 127)
# token types of an image span (DeepSeek-V4.1: text is -1)
TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3
READ_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
"""The picture formats read (Pillow's names); no other plugin is consulted for a file."""
READ_NAMES = "PNG, JPEG, WebP, GIF, BMP and TIFF"
# A decoded picture's format may also be JPEG's multi-picture variant (Pillow's JPEG reader).
_DECODED_FORMATS = frozenset((*READ_FORMATS, "MPO"))
# Headers named in the refusal of a file of another format (never handed to its plugin).
_OTHER_HEADERS = ((b"%!", "PostScript/EPS"), (b"\xc5\xd0\xd3\xc6", "EPS"), (b"%PDF", "PDF"))
GRID_BOUNDS = {"patch_size": 224, "downsample_ratio": 48, "max_image_tokens": 1 << 14,
               "min_pixels": 16 * 295936, "max_wh_ratio": 1 << 14}  # fmt: skip
"""Upper bounds of the image settings: about 16x DeepSeek-V4.1-Flash's (patch 14, downsample 3,
1024 image tokens, 295936 pixels); max_wh_ratio (null in the release) is bounded as
max_image_tokens is, no span being that many cells wide. A value above its bound is a typo or not
this model."""
MAX_PLAN_PIXELS = 16 * 1024 * 42**2
"""The largest picture the settings may plan, max_image_tokens x (patch_size x downsample_ratio)^2
pixels: 16x DeepSeek-V4.1-Flash's 1024 x 42^2 (about 174 MB of bf16 patches)."""
_LOWEST = {"patch_size": 1, "downsample_ratio": 1, "max_image_tokens": 5, "min_pixels": 1}
# (max_image_tokens: one cell is a start, the cell, a new line and an end)


class ImageFormatError(DataError):
    """A picture of a format that is not read (`READ_FORMATS`); its decoder was never run."""


@dataclass(frozen=True, kw_only=True)
class ImageGrid:
    """The image sizes of a release's `vision_config` (its field names)."""

    patch_size: int = 14
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None

    def __post_init__(self) -> None:
        """Refuse a setting of the wrong type or out of its range before anything is sized by it
        (ConfigError naming `vision_config.<field>`)."""
        for name, lowest in _LOWEST.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"vision_config.{name} must be an integer, got {value!r}")
            if value < lowest:
                raise ConfigError(f"vision_config.{name} must be >= {lowest}, got {value}")
            _bounded(name, value)
        ratio = self.max_wh_ratio
        if ratio is not None:
            if (not isinstance(ratio, int | float) or isinstance(ratio, bool)
                    or not math.isfinite(ratio) or ratio <= 0):  # fmt: skip
                raise ConfigError(
                    f"vision_config.max_wh_ratio must be a number > 0 or null, got {ratio!r}"
                )
            _bounded("max_wh_ratio", ratio)
        pixels = self.max_image_tokens * (self.patch_size * self.downsample_ratio) ** 2
        if pixels > MAX_PLAN_PIXELS:
            raise ConfigError(
                f"vision_config: max_image_tokens={self.max_image_tokens} of cells of "
                f"(patch_size={self.patch_size} x downsample_ratio={self.downsample_ratio})^2 "
                f"pixels plan pictures of {pixels} pixels, above the bound {MAX_PLAN_PIXELS} "
                "(16x DeepSeek-V4.1-Flash's)"
            )

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


def _bounded(name: str, value: float) -> None:
    bound = GRID_BOUNDS[name]
    if value > bound:
        raise ConfigError(
            f"vision_config.{name}={value} is above its bound {bound} (about 16x "
            "DeepSeek-V4.1-Flash's; a size this large is a typo or not this model)"
        )


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


def channel_bits(picture: Any) -> int:
    """Bits per channel of a picture as its file stores them, before any conversion: 32 for
    Pillow's `I` and `F` modes, 16 for `I;16*`, a 16-bit PNG (Pillow reads 16-bit RGB(A) as its
    8-bit high bytes) or a TIFF of 16-bit samples; 8 for anything of 8 bits or fewer."""
    mode = picture.mode
    if mode in ("I", "F"):
        return 32
    if mode.startswith("I;16"):
        return 16
    bits = 8
    if picture.format == "PNG":  # the raw mode of a picture not yet decoded: "RGB;16B"
        raw = [t.args for t in getattr(picture, "tile", ()) if isinstance(t.args, str)]
        bits = 16 if any(r.endswith(";16B") for r in raw) else bits
    elif picture.format == "TIFF":
        samples = getattr(picture, "tag_v2", {}).get(258, ())  # BitsPerSample
        samples = samples if isinstance(samples, tuple) else (samples,)
        bits = max([bits, *(b for b in samples if isinstance(b, int))])
    return bits


def _refusal(fmt: str | None) -> str:
    return f"{fmt + ', ' if fmt else ''}a format not read (only {READ_NAMES} pictures are read)"


def _other_format(image: Any) -> str | None:
    """The format of a file no reader of `READ_FORMATS` took, when its header names one."""
    try:
        if isinstance(image, bytes | bytearray):
            head = bytes(image[:8])
        else:
            with Path(image).open("rb") as f:
                head = f.read(8)
    except OSError:
        return None
    return next((name for start, name in _OTHER_HEADERS if head.startswith(start)), None)


def _pillow() -> Any:
    """Pillow's Image module with the readers of `READ_FORMATS` registered (so that opening a
    file with them alone never makes Pillow import every plugin)."""
    import importlib

    from PIL import Image

    for module in ("Png", "Jpeg", "WebP", "Gif", "Bmp", "Tiff"):
        importlib.import_module(f"PIL.{module}ImagePlugin")
    return Image


def read_picture(image: Any, *, where: str = "") -> tuple[Any, int]:
    """(the picture in RGB, its bits per channel as stored: `channel_bits`) of a PIL image, a
    path, or the file's bytes. A file is opened by the readers of `READ_FORMATS` alone; another
    format (a decoded picture's too) is an ImageFormatError and a missing or unreadable file a
    DataError, each naming it (and `where`, e.g. the row)."""
    from PIL import UnidentifiedImageError

    pil = _pillow()
    name = "<bytes>" if isinstance(image, bytes | bytearray) else str(image)
    at = f" ({where})" if where else ""
    if isinstance(image, pil.Image):
        if image.format is not None and image.format not in _DECODED_FORMATS:
            raise ImageFormatError(f"image <picture>{at}: {_refusal(image.format)}")
        bits = channel_bits(image)  # before the conversion decodes it
        return image.convert("RGB"), bits
    try:
        source = io.BytesIO(image) if isinstance(image, bytes | bytearray) else Path(image)
        formats = [f for f in READ_FORMATS if f in pil.OPEN]  # never Image.init()'s others
        with pil.open(source, formats=formats) as opened:
            bits = channel_bits(opened)  # before the conversion decodes it
            return opened.convert("RGB"), bits
    except UnidentifiedImageError:
        detail = _refusal(_other_format(image))
        raise ImageFormatError(f"image {name}{at}: cannot read it as a picture: {detail}") from None
    except (OSError, ValueError, pil.DecompressionBombError) as exc:
        raise DataError(f"image {name}{at}: cannot read it as a picture: {exc}") from None


def open_image(image: Any, *, where: str = "") -> Any:
    """A PIL image in RGB from a PIL image, a path, or the file's bytes (`read_picture`)."""
    return read_picture(image, where=where)[0]


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

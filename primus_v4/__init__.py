"""primus_v4: packed (THD) supervised fine-tuning of the DeepSeek-V4 family, from one CPU process
to many nodes.

The stable public API: `load_pretrained` and `save_pretrained` (a release directory in and out,
dispatched on its config.json `model_type` to the model family that owns it), and
`image_patches` (a picture as DeepSeek-V4.1's ViT takes it, primus_v4/data/images.py).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__version__ = "0.1.0"
__all__ = ["__version__", "image_patches", "load_pretrained", "save_pretrained"]


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    keep_release: bool = False,
    progress: bool = True,
) -> nn.Module:
    """The model of a release directory (config.json + safetensors shards, FP8/FP4 or bf16):
    every parameter and persistent buffer loaded, FP8/FP4 decoded into `dtype` (float32 by
    default), or with `keep_release` kept as the release stores it and decoded per use."""
    import torch

    from primus_v4.models import release_spec

    spec = release_spec(path)
    return spec.release.load(
        path,
        dtype=torch.float32 if dtype is None else dtype,
        device=device,
        keep_release=keep_release,
        progress=progress,
    )


def save_pretrained(
    model: nn.Module, out: str | os.PathLike, *, dtype: str = "bfloat16", **options: Any
) -> Any:
    """Write a whole model in its family's release layout (`dtype` "bfloat16", "float32" or
    "fp8": the release's FP8/FP4 mix); returns the write summary (files, tensors, bytes)."""
    from primus_v4.models import spec_of

    return spec_of(model).release.save(model, out, dtype=dtype, **options)


def image_patches(image: Any, config: Any) -> tuple[torch.Tensor, tuple[int, int]]:
    """(patches bf16 [h * w, 3, 14, 14], (h, w) the ViT grid) of `image` (a path, the file's
    bytes or a PIL image) as DeepSeek-V4.1's image processor makes them, sized by `config` (a
    release's config.json dict or model config with its `vision_config`, or that mapping)."""
    from primus_v4.data.images import image_patches as patches_of

    return patches_of(image, config)

"""DeepSeek-V4.1's image encoder: the ViT over one image's patches, then the aligner that turns
each 3 x 3 cell of patches into one vector of the language model's width.

Legend: N = patches of one image (n_h x n_w, row-major), C = the ViT's width, H = its heads,
d = C / H (head dim), r = the aligner's downsample (3), M = cells (ceil(n_h / r) x ceil(n_w / r),
row-major), D = the language model's width.

What the release computes (DeepSeek-V4.1's inference/vision.py; the module names here are the
release's tensor names, so a release loads by name):
- `vision.patch_embed.proj`: Linear(3 p^2 -> C, bias) on each patch flattened channel-major;
- `vision.blocks.i`: x += wo(attention(rope(q), rope(k), v)) of norm1(x), then
  x += w2(silu(g) * u) with [g | u] = w1(norm2(x)); `wqkv` / `wo` with bias, `w1` / `w2` without;
  the attention is bidirectional over the image's patches alone, scaled d^-1/2; RMSNorm with eps
  1e-6 (not the backbone's), computed in float32;
- 2-D rotary positions on q and k: the head's first and second halves are paired (rotate-half,
  not the backbone's interleaved pairs); pair j turns by row x f_j for j < d/4 and by
  column x f_(j - d/4) after, f_k = theta^(-4k/d);
- `vision.norm`: RMSNorm over every patch;
- `aligner`: the [n_h, n_w, C] grid zero-padded right and bottom to multiples of r, each r x r
  cell flattened channel-major (c r^2 + dy r + dx), then w2(gelu(w1(x))) with the exact (erf)
  GELU, both with bias: [M, D];
- `image_start`, `image_newline`, `image_end`: the vectors of an image span's delimiters.
The release stores all of it in bf16.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from primus_v4.errors import CheckpointFormatError
from primus_v4.models.deepseek_v41.geometry import check_vision_sizes

NORM_EPS = 1e-6
SPAN_VECTORS = ("image_start", "image_newline", "image_end")


@dataclass(frozen=True, kw_only=True)
class VisionSizes:
    """The encoder's sizes: a release's `vision_config` and the language model's width."""

    layers: int
    width: int
    heads: int
    ffn: int
    patch: int = 14
    rope_theta: float = 10000.0
    downsample: int = 3
    text_width: int

    @classmethod
    def of(cls, config: dict[str, Any], *, source: str = "config.json") -> VisionSizes:
        """From a release's config.json (its `vision_config` and `text_config`), its sizes
        checked first (`check_vision_sizes`: bounded, required, heads that split the width)."""
        vision = config.get("vision_config")
        check_vision_sizes(vision, source=source)
        text = config.get("text_config", config)
        return cls(layers=vision["num_hidden_layers"], width=vision["hidden_size"],
                   heads=vision["num_attention_heads"], ffn=vision["intermediate_size"],
                   patch=vision.get("patch_size", 14),
                   rope_theta=float(vision.get("rope_theta", 10000.0)),
                   downsample=vision.get("downsample_ratio", 3),
                   text_width=text["hidden_size"])  # fmt: skip


class _Norm(nn.Module):
    # a drawn init (weight_init.py) starts it at one
    constant_params: ClassVar[dict[str, float]] = {"weight": 1.0}

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + NORM_EPS)
        return (self.weight.float() * x32).to(x.dtype)


def grid_angles(n_h: int, n_w: int, head_dim: int, theta: float) -> torch.Tensor:
    """[N, d / 2] float32: each patch's angle per rotated pair (the module docstring)."""
    quarter = head_dim // 4
    freqs = theta ** -(torch.arange(quarter, dtype=torch.float32) * 4 / head_dim)
    rows = torch.arange(n_h, dtype=torch.float32).repeat_interleave(n_w)
    cols = torch.arange(n_w, dtype=torch.float32).repeat(n_h)
    return torch.cat([rows[:, None] * freqs, cols[:, None] * freqs], dim=1)


def _rotate(x_NHd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x_NHd.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x_NHd.dtype)


class _Attention(nn.Module):
    def __init__(self, s: VisionSizes) -> None:
        super().__init__()
        self.heads = s.heads
        self.wqkv = nn.Linear(s.width, 3 * s.width)
        self.wo = nn.Linear(s.width, s.width)

    def forward(self, x_NC: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x_NC.shape[0]
        q, k, v = (t.view(n, self.heads, -1) for t in self.wqkv(x_NC).chunk(3, dim=-1))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o_HNd = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                               v.transpose(0, 1))  # fmt: skip
        return self.wo(o_HNd.transpose(0, 1).reshape(n, -1))


class _Mlp(nn.Module):
    def __init__(self, s: VisionSizes) -> None:
        super().__init__()
        self.w1 = nn.Linear(s.width, 2 * s.ffn, bias=False)
        self.w2 = nn.Linear(s.ffn, s.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(g) * u)


class VisionBlock(nn.Module):
    def __init__(self, s: VisionSizes) -> None:
        super().__init__()
        self.norm1, self.attn = _Norm(s.width), _Attention(s)
        self.norm2, self.mlp = _Norm(s.width), _Mlp(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, s: VisionSizes) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * s.patch * s.patch, s.width)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.flatten(1).to(self.proj.weight.dtype))


class VisionTower(nn.Module):
    """The ViT: patches [N, 3, p, p] of one image -> [N, C]."""

    def __init__(self, s: VisionSizes) -> None:
        super().__init__()
        self.sizes = s
        self.patch_embed = _PatchEmbed(s)
        self.blocks = nn.ModuleList(VisionBlock(s) for _ in range(s.layers))
        self.norm = _Norm(s.width)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        n_h, n_w = grid
        if patches.shape[0] != n_h * n_w:
            raise ValueError(f"{patches.shape[0]} patches for a {n_h} x {n_w} grid")
        angles = grid_angles(n_h, n_w, self.sizes.width // self.sizes.heads, self.sizes.rope_theta)
        cos = angles.cos().to(patches.device)[:, None]
        sin = angles.sin().to(patches.device)[:, None]
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """[n_h * n_w, C] -> [M, D]: one vector per r x r cell of patches."""

    def __init__(self, s: VisionSizes) -> None:
        super().__init__()
        self.r = s.downsample
        self.w1 = nn.Linear(s.width * s.downsample**2, s.text_width)
        self.w2 = nn.Linear(s.text_width, s.text_width)

    def forward(self, x_NC: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        (n_h, n_w), r = grid, self.r
        x_CHW = F.pad(x_NC.view(n_h, n_w, -1).permute(2, 0, 1), (0, -n_w % r, 0, -n_h % r))
        cells = F.unfold(x_CHW[None], r, stride=r)[0].transpose(0, 1)  # [M, C r r]
        return self.w2(F.gelu(self.w1(cells)))


class ImageEncoder(nn.Module):
    """The release's `vision.*`, `aligner.*` and span vectors; `encode_image` is the image
    embeddings of one image."""

    def __init__(self, s: VisionSizes) -> None:
        super().__init__()
        self.sizes = s
        self.vision = VisionTower(s)
        self.aligner = Aligner(s)
        for name in SPAN_VECTORS:
            self.register_parameter(name, nn.Parameter(torch.zeros(s.text_width)))

    def encode_image(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """patches [h * w, 3, p, p] of one image and its ViT grid (h, w) -> [cells, D]."""
        return self.aligner(self.vision(patches, grid), grid)


def vision_sizes(cfg: Any) -> VisionSizes:
    """The encoder's sizes of a DeepseekV41Config (its release's `vision_config`)."""
    if not cfg.vision_config:
        raise CheckpointFormatError("the model config has no vision_config: no image encoder")
    return VisionSizes.of({"vision_config": cfg.vision_config,
                           "text_config": {"hidden_size": cfg.hidden_size}})  # fmt: skip


def vision_tensors(cfg: Any) -> dict[str, tuple[int, ...]]:
    """{release name: shape} of the image encoder's parts a run trains (`vision_train`): the
    aligner and span vectors, and with `all` the tower (empty when frozen)."""
    if cfg.vision_train == "frozen":
        return {}
    with torch.device("meta"):
        encoder = ImageEncoder(vision_sizes(cfg))
    tower = cfg.vision_train == "all"
    return {name: tuple(t.shape) for name, t in encoder.state_dict().items()
            if tower or not name.startswith("vision.")}  # fmt: skip


def load_image_encoder(
    directory: str | os.PathLike, *, dtype: torch.dtype = torch.float32, tower_only: bool = False
) -> ImageEncoder | VisionTower:
    """The image encoder of a V4.1 release (its config.json and bf16 `vision.*`, `aligner.*`,
    span-vector tensors), in `dtype`; with `tower_only` its ViT alone (`vision.*`). A missing or
    misshapen tensor is named."""
    import json
    from pathlib import Path

    from primus_v4.checkpoint_formats.sharded import CheckpointReader

    config = json.loads((Path(directory) / "config.json").read_text())
    if "vision_config" not in config:
        raise CheckpointFormatError(f"{directory}: config.json has no vision_config: this "
                                    "release has no image encoder")  # fmt: skip
    sizes = VisionSizes.of(config)
    encoder = (VisionTower(sizes) if tower_only else ImageEncoder(sizes)).to(dtype)
    prefix = "vision." if tower_only else ""
    with CheckpointReader(directory) as reader:
        stored = set(reader.names())
        state = {prefix + name: t for name, t in encoder.state_dict().items()}
        missing = sorted(set(state) - stored)
        if missing:
            more = " ..." if len(missing) > 6 else ""
            raise CheckpointFormatError(
                f"{directory}: the image encoder's tensors {missing[:6]}{more} are missing"
            )
        with torch.no_grad():
            for name, t in state.items():
                t.copy_(reader.read(name, dtype, shape=tuple(t.shape)))
    return encoder


def cells_of(grid: tuple[int, int], downsample: int) -> int:
    return math.ceil(grid[0] / downsample) * math.ceil(grid[1] / downsample)

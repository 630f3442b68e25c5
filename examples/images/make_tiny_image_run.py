"""A tiny DeepSeek-V4.1 with a tiny vision tower, a small corpus of synthetic pictures and the run
that fine-tunes one on the other, all made here (seeded), so training on images runs on a CPU:

    python examples/images/make_tiny_image_run.py OUT_DIR
    primus-v4 train --config OUT_DIR/run.yaml
    primus-v4 export --run OUT_DIR/outputs --out OUT_DIR/export

OUT_DIR/release: the tiny_v41 preset drawn from a seed and saved in the release layout (bf16),
plus a 2-block image encoder (`vision.*`, `aligner.*`, the span vectors; bf16) and the
`vision_config` / `image_token_id` of DeepSeek-V4.1-Flash's config.json (its image processor's
settings, smaller pictures); the V4.1 tokenizer beside it (tests/fixtures/dsv41_tokenizer).
OUT_DIR/pictures: 12 PNGs, a shape (circle, square, triangle) in a color (red, green, blue,
yellow) on a grey ground, of three sizes. OUT_DIR/corpus.jsonl: 48 conversations in the OpenAI
format, a picture and a question, the answer naming its color and shape.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "tests" / "fixtures" / "dsv41_tokenizer" / "tokenizer.json"
IMAGE_TOKEN_ID = 129264  # DeepSeek-V4.1's <｜deepseek_image｜>
VISION = {
    "model_type": "deepseek_v41_vision",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 96,
    "patch_size": 14,
    "rope_theta": 10000,
    "downsample_ratio": 3,
    "max_image_tokens": 64,
    "min_pixels": 4900,
    "max_wh_ratio": None,
}
COLORS = {"red": (210, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 210),
          "yellow": (230, 200, 40)}  # fmt: skip
SHAPES = ("circle", "square", "triangle")
SIZES = ((70, 70), (98, 70), (84, 112))
QUESTIONS = ("What is in the picture?", "Describe the picture.", "Which shape is this?",
             "Name the color and the shape.")  # fmt: skip
SEED = 1234


def write_release(out: Path) -> None:
    """The tiny V4.1 text model and image encoder, drawn from SEED, as a release: each text
    tensor stored as the release stores it (FP8 / FP4 with e8m0 scales, bf16, float32), the
    encoder in bf16; one shard for the text model and one for the encoder."""
    import torch
    from safetensors.torch import save_file

    from primus_v4.checkpoint_formats.fp8_fp4 import quantize
    from primus_v4.models import spec_of
    from primus_v4.models.deepseek_v41.config import DeepseekV41Config
    from primus_v4.models.deepseek_v41.model import DeepseekV41Model
    from primus_v4.models.deepseek_v41.release.export import release_state
    from primus_v4.models.deepseek_v41.release.tensors import FORMATS, PLAIN, kind_of
    from primus_v4.models.deepseek_v41.vision import ImageEncoder, VisionSizes

    out.mkdir(parents=True)
    torch.manual_seed(SEED)
    cfg = DeepseekV41Config.preset("tiny_v41")
    model = DeepseekV41Model(cfg)
    model.init_weights(SEED)
    config = spec_of(cfg).release.config_json(cfg)
    config.update(vision_config=VISION, image_token_id=IMAGE_TOKEN_ID)
    encoder = ImageEncoder(VisionSizes.of(config))
    with torch.no_grad():
        for name in ("image_start", "image_end", "image_newline"):
            getattr(encoder, name).normal_(0.0, 0.02)
    text = {}
    for name, tensor in release_state(model).items():  # stored as the release stores each
        kind = kind_of(name)
        if kind in FORMATS:  # FP8 / FP4 codes and their e8m0 scales
            codes, scales = quantize(tensor.detach().float(), fmt=FORMATS[kind])
            text[name], text[name.removesuffix(".weight") + ".scale"] = codes, scales
        else:
            text[name] = tensor.detach().to(PLAIN[kind])
    for layer in range(cfg.num_layers):  # the image tokens' routing bias (float32, as released)
        text[f"layers.{layer}.ffn.gate.bias_vl"] = torch.zeros(cfg.num_moe_experts)
    vision = {k: v.detach().to(torch.bfloat16) for k, v in encoder.state_dict().items()}
    weight_map = {}
    for file, tensors in (("model-text.safetensors", text), ("model-vision.safetensors", vision)):
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(TOKENIZER, out / "tokenizer.json")


def draw_pictures(out: Path) -> list[tuple[str, str, str]]:
    """(file, color, shape) of each synthetic picture."""
    from PIL import Image, ImageDraw

    out.mkdir(parents=True, exist_ok=True)
    made = []
    for k, (color, rgb) in enumerate(COLORS.items()):
        for j, shape in enumerate(SHAPES):
            w, h = SIZES[(k + j) % len(SIZES)]
            picture = Image.new("RGB", (w, h), (128, 128, 128))
            draw = ImageDraw.Draw(picture)
            box = (w // 6, h // 6, w - w // 6, h - h // 6)
            if shape == "circle":
                draw.ellipse(box, fill=rgb)
            elif shape == "square":
                draw.rectangle(box, fill=rgb)
            else:
                draw.polygon([(w // 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=rgb)
            name = f"{color}_{shape}.png"
            picture.save(out / name)
            made.append((name, color, shape))
    return made


def write_corpus(path: Path, pictures: list[tuple[str, str, str]]) -> None:
    rows = []
    for q, question in enumerate(QUESTIONS):
        for name, color, shape in pictures:
            user = [{"type": "image_url", "image_url": {"url": f"pictures/{name}"}},
                    {"type": "text", "text": question}]  # fmt: skip
            if q % 2:  # the picture after the question, too
                user.reverse()
            answer = f"A {color} {shape}."
            rows.append({"messages": [{"role": "user", "content": user},
                                      {"role": "assistant", "content": answer}]})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def write_run(out: Path) -> None:
    run = f"""\
# A tiny DeepSeek-V4.1 with a tiny vision tower fine-tuned on synthetic pictures (made by
# examples/images/make_tiny_image_run.py). The image encoder is the release's, frozen.
data:
  path: {out / "corpus.jsonl"}
  seq_length: 512
  cache_dir: ${{PRIMUS_PACK_CACHE_DIR:null}}
  lock_dir: ${{PRIMUS_PACK_LOCK_DIR:null}}
model:
  preset: null
  pretrained: {out / "release"}
  dtype: float32
train:
  steps: 30
  seed: {SEED}
  global_batch_size: 1
  lr: 5.0e-3
  min_lr: 5.0e-4
  warmup_steps: 3
output:
  dir: {out / "outputs"}
checkpoint:
  dir: {out / "outputs" / "checkpoints"}
  interval: 30
"""
    (out / "run.yaml").write_text(run, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write (must not exist)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if out.exists():
        parser.error(f"{out} exists; choose a new directory")
    write_release(out / "release")
    write_corpus(out / "corpus.jsonl", draw_pictures(out / "pictures"))
    write_run(out)
    print(f"wrote {out}: release/, pictures/, corpus.jsonl, run.yaml\n"
          f"train: primus-v4 train --config {out / 'run.yaml'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

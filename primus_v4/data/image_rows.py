"""Rows with images: where a row's images sit, where their bytes come from, and the checks that
make a bad image a bad row (never a silent drop).

The shapes users bring (all read here, before `shapes` normalizes the row):
- OpenAI-style content lists: parts `{"type": "image_url", "image_url": {"url": ...}}`,
  `{"type": "image_url", "image_url": "..."}`, `{"type": "image", "image": ...}` and
  `{"type": "input_image", "image_url": ...}` beside `{"type": "text", "text": ...}`;
- ShareGPT / LLaVA-style `<image>` placeholders in the text with an `images` (a list) or `image`
  (one) column, the images taken in the order their placeholders appear in the conversation.

An image is a local path (relative to the corpus file's directory), a `file://` URL, a base64
`data:` URL, raw bytes, a hub `Image` feature (`{"bytes", "path"}` or a decoded picture). A URL
of any other scheme is a bad row (`image_not_local`): packing never downloads. A file is read as
a PNG, JPEG, WebP, GIF, BMP or TIFF picture alone (`images.READ_FORMATS`); any other, EPS,
PostScript and PDF included, is a bad row (`image_format`) whose decoder never runs. The text of a
content list becomes one string: text parts joined by a blank line (as `shapes` joins them), each
image part the V4.1 placeholder `<｜deepseek_image｜>` in its place, with nothing around it (ours:
DeepSeek's encoder renders no content lists). The placeholder then tokenizes to the release's
`image_token_id`, which the tokenization expands into the image's span (`images.span_types`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import stat
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primus_v4.data.images import ImageFormatError, ImageGrid, open_image, plan_grid, read_picture
from primus_v4.data.shapes import IMAGE_FIELDS, IMAGE_PARTS, MESSAGE_LISTS, BadRow
from primus_v4.errors import ConfigError, DataError

PLACEHOLDER = "<｜deepseek_image｜>"
"""V4.1's image placeholder (its tokenizer's `image_token_id`, 129264 in the release)."""
LLAVA_PLACEHOLDER = "<image>"
MAX_IMAGE_BYTES = 64 << 20
"""An image file above this is a bad row (`image_unreadable`): no SFT picture is this large, and
a bound keeps one hostile row from filling memory."""
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True, kw_only=True)
class RowImages:
    """How rows with images are read for a model with a vision tower: its grid (the release's
    vision_config), its image token id, and the directory relative image paths start from."""

    grid: ImageGrid
    token_id: int
    base: Path | None = None


def vision_of(release_dir: Path, chat_format: str) -> RowImages | None:
    """How rows with images are read for the release at `release_dir` (its config.json's
    `vision_config` and `image_token_id`, a V4.1 conversation format): None for a model
    without a vision tower, whose image rows stay bad rows (`image`)."""
    path = Path(release_dir) / "config.json"
    if chat_format != "v4.1" or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read the release's config: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("vision_config"), dict):
        return None
    token_id = config.get("image_token_id")
    if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
        raise DataError(f"{path}: vision_config without an image_token_id (got {token_id!r})")
    try:
        grid = ImageGrid.of(config)
    except ConfigError as exc:  # a setting out of its bounds, named
        raise DataError(f"{path}: {exc}") from None
    return RowImages(grid=grid, token_id=token_id)


@dataclass(frozen=True, kw_only=True)
class ImageSource:
    """One image of a row: where it came from, its bytes' sha256 and its plan on the LLM grid."""

    name: str  # the path, or `<data URL>` / `<bytes>` / `<picture>`
    digest: str  # sha256 of the file's bytes (or of a decoded picture's mode, size and pixels)
    path: Path | None  # read again when patches are made (the digest is checked then)
    data: bytes | None  # inline bytes (data URLs, hub bytes); None for a path
    llm_h: int
    llm_w: int
    bits: int = 8  # per channel as stored; above 8 the picture is counted (`images.channel_bits`)

    @property
    def span(self) -> int:
        return self.llm_h * (self.llm_w + 1) + 2

    def read(self) -> Any:
        """The RGB picture, from the same bytes the digest was taken of (DataError if the file
        changed since)."""
        if self.path is None:
            return open_image(self.data, where=self.name)
        data = self.path.read_bytes()
        if hashlib.sha256(data).hexdigest() != self.digest:
            raise DataError(f"image {self.path} changed after it was read (sha256 differs)")
        return open_image(data, where=self.name)


def _part_image(part: dict[str, Any]) -> Any:
    """The image reference of an image content part."""
    value = part.get(part["type"])
    if value is None:
        value = part.get("image_url", part.get("image"))
    if isinstance(value, dict) and "url" in value:
        return value["url"]
    return value


def _join_parts(parts: list[Any], where: str, refs: list[Any]) -> str:
    """A content list with images as one string (module docstring); image refs appended."""
    out: list[str] = []
    last_text = False
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in IMAGE_PARTS:
            refs.append(_part_image(part))
            out.append(PLACEHOLDER)
            last_text = False
        elif kind == "text" and isinstance(part.get("text"), str):
            out.append(("\n\n" if last_text else "") + part["text"])
            last_text = True
        else:
            raise BadRow(
                "unsupported_content",
                f"{where} content part {k} is {kind!r}; only text and image parts can be rendered",
            )
    return "".join(out)


def _with_parts_joined(row: dict[str, Any], refs: list[Any]) -> dict[str, Any]:
    """The row with every content list holding an image made one string (a shallow copy of
    what changes); the images' refs in conversation order."""
    row = dict(row)
    for key in MESSAGE_LISTS:
        messages = row.get(key)
        if not isinstance(messages, list):
            continue
        changed = []
        for i, msg in enumerate(messages):
            field = "content" if isinstance(msg, dict) and "content" in msg else "value"
            parts = msg.get(field) if isinstance(msg, dict) else None
            if isinstance(parts, list) and any(
                isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in parts
            ):
                msg = {**msg, field: _join_parts(parts, f"{key}[{i}]", refs)}
            changed.append(msg)
        row[key] = changed
    return row


def _column_images(row: dict[str, Any]) -> list[Any]:
    images = [row[k] for k in IMAGE_FIELDS if row.get(k) not in (None, [], "")]
    if len(images) > 1:
        raise BadRow("image_count", "both an 'images' and an 'image' field: give one")
    if not images:
        return []
    value = images[0]
    return list(value) if isinstance(value, list | tuple) else [value]


def _replace_llava(messages: list[dict[str, Any]]) -> int:
    """`<image>` -> the V4.1 placeholder in every message's text; how many were replaced."""
    count = 0
    for msg in messages:
        for field in ("content", "reasoning_content"):
            text = msg.get(field)
            if isinstance(text, str) and LLAVA_PLACEHOLDER in text:
                count += text.count(LLAVA_PLACEHOLDER)
                msg[field] = text.replace(LLAVA_PLACEHOLDER, PLACEHOLDER)
    return count


def take_images(row: dict[str, Any]) -> tuple[dict[str, Any], list[Any], bool]:
    """(the row with image content parts as placeholders and its image fields removed, the
    image refs in conversation order, whether they came from content parts rather than the
    `images` / `image` column). The `<image>` placeholders of a column's images are replaced
    after `shapes` normalizes the row (`place_column_images`)."""
    refs: list[Any] = []
    joined = _with_parts_joined(row, refs)
    column = _column_images(joined)
    if column and refs:
        raise BadRow(
            "image_count",
            f"{len(refs)} image content parts and an images column of {len(column)}: give the "
            "images one way",
        )
    for k in IMAGE_FIELDS:
        joined.pop(k, None)
    return joined, refs or column, bool(refs)


def place_column_images(messages: list[dict[str, Any]], refs: list[Any], *, parts: bool) -> None:
    """Check that the conversation shows one placeholder per image (LLaVA's `<image>` made the
    V4.1 placeholder first, for a column of images); raises BadRow `image_count`."""
    if refs and not parts:
        _replace_llava(messages)
    shown = sum(
        text.count(PLACEHOLDER)
        for m in messages
        for text in (m.get("content"), m.get("reasoning_content"))
        if isinstance(text, str)
    )
    if shown != len(refs):
        what = "image placeholders" if parts else f"{LLAVA_PLACEHOLDER} placeholders"
        raise BadRow(
            "image_count",
            f"{shown} {what} in the conversation but {len(refs)} images; give one image per "
            "placeholder",
        )


def _bytes_of(ref: Any, k: int, base: Path | None) -> tuple[str, Path | None, bytes | None]:
    """(name, path, inline bytes) of image `k`'s ref; raises BadRow."""
    if isinstance(ref, bytes | bytearray):
        return "<bytes>", None, bytes(ref)
    if isinstance(ref, dict):  # a hub Image feature, or an image_url object
        if ref.get("bytes"):
            return str(ref.get("path") or "<bytes>"), None, bytes(ref["bytes"])
        ref = ref.get("path", ref.get("url"))
    if not isinstance(ref, str) or not ref:
        raise BadRow("image_missing", f"image {k + 1} is {type(ref).__name__}, not a path or URL")
    if ref.startswith("data:"):
        head, _, body = ref.partition(",")
        if ";base64" not in head:
            raise BadRow("image_unreadable", f"image {k + 1}: a data URL that is not base64")
        try:
            return "<data URL>", None, base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BadRow("image_unreadable", f"image {k + 1}: bad base64 ({exc})") from None
    if ref.startswith("file://"):
        ref = urllib.parse.unquote(urllib.parse.urlparse(ref).path)
    elif _SCHEME.match(ref):
        raise BadRow(
            "image_not_local",
            f"image {k + 1} is {ref[:120]}: not a local file (packing never downloads); download "
            "it and give its path",
        )
    path = Path(ref).expanduser()
    if not path.is_absolute():
        if base is None:
            raise BadRow("image_missing", f"image {k + 1}: relative path {ref} and no corpus dir")
        path = base / path
    return str(path), path, None


def resolve_images(refs: list[Any], base: Path | None, grid: ImageGrid) -> list[ImageSource]:
    """Each ref read, decoded once (a corrupt file is found here), hashed and planned on the LLM
    grid; raises BadRow `image_missing`, `image_unreadable`, `image_format` or `image_not_local`
    naming it."""
    out = []
    for k, ref in enumerate(refs):
        picture = ref if hasattr(ref, "tobytes") and hasattr(ref, "mode") else None
        if picture is not None:
            name, path, data = "<picture>", None, None
        else:
            name, path, data = _bytes_of(ref, k, base)
        if path is not None:
            try:
                if not stat.S_ISREG(path.stat().st_mode):  # a FIFO or /dev/zero never ends
                    raise BadRow("image_unreadable", f"image {k + 1} ({path}): not a regular "
                                 "file")  # fmt: skip
                size = path.stat().st_size
                if size > MAX_IMAGE_BYTES:
                    raise BadRow("image_unreadable", f"image {k + 1} ({path}): {size} bytes, "
                                 f"above the bound {MAX_IMAGE_BYTES}")  # fmt: skip
                data = path.read_bytes()
            except FileNotFoundError:
                raise BadRow("image_missing", f"image {k + 1} ({path}): no such file") from None
            except OSError as exc:
                detail = exc.strerror or str(exc)
                raise BadRow("image_unreadable", f"image {k + 1} ({path}): {detail}") from None
        try:
            picture, bits = read_picture(picture if picture is not None else data)
        except ImageFormatError as exc:
            raise BadRow("image_format", f"image {k + 1} ({name}): {exc}") from None
        except DataError as exc:
            raise BadRow("image_unreadable", f"image {k + 1} ({name}): {exc}") from None
        if data is None:  # a decoded picture: its pixels stand for the file
            digest = hashlib.sha256(
                f"{picture.mode}{picture.size}".encode() + picture.tobytes()
            ).hexdigest()
            data = _png(picture)
        else:
            digest = hashlib.sha256(data).hexdigest()
        plan = plan_grid(picture.width, picture.height, grid)
        out.append(ImageSource(name=name, digest=digest, path=path,
                               data=None if path is not None else data,
                               llm_h=plan.llm_h, llm_w=plan.llm_w, bits=bits))  # fmt: skip
    return out


def _png(picture: Any) -> bytes:
    import io

    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()

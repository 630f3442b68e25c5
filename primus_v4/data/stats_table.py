"""A corpus's packing statistics (pipeline.build_or_load's `stats`) as an aligned table."""

from __future__ import annotations

from typing import Any


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "none"
    return str(value)


def _special(counts: dict[str, int] | None) -> str:
    if not counts:
        return "not counted"
    return f"{counts['rows']} ({counts['occurrences']} occurrences)"


def _above_8_bit(stats: dict[str, Any]) -> str:
    first = stats.get("first_image_above_8_bit")
    return f"{stats['images_above_8_bit']}" + (f" (first: {first})" if first else "")


def summary_table(stats: dict[str, Any]) -> str:
    """A pack's statistics as aligned `name  value` lines (`primus-v4 pack`, the trainer's log)."""
    rows = [
        ("cache", f"{'hit' if stats['cache_hit'] else 'built'}  key={stats['cache_key']}"),
        ("cache dir", stats.get("cache_dir", "")),
        ("format", stats.get("format", "")),
        ("rows read", stats.get("num_rows", "")),
        ("chat format", stats.get("chat_format", "")),
        ("chat modes (rows)", _fmt(stats.get("chat_modes", {}))),
        ("bad rows", _fmt(stats["bad_rows"])),
        ("special-token text (rows)", _special(stats.get("special_tokens_in_text"))),
        *(
            (f"  first bad row {k + 1}", f"{e['where']}: {e['detail']}")
            for k, e in enumerate(stats.get("bad_row_examples", []))
        ),
        ("samples", stats["num_samples"]),
        ("truncated / dropped", f"{stats['truncated']} / {stats['dropped']}"),
        ("packs (lower bound)", f"{stats['num_packs']} ({stats.get('lower_bound_packs', '?')})"),
        (
            "samples per pack",
            f"{stats.get('samples_per_pack_mean', 0):.2f} mean, "
            f"{stats.get('samples_per_pack_min', 0)}-{stats.get('samples_per_pack_max', 0)}",
        ),
        ("total tokens", stats["total_tokens"]),
        ("real tokens", f"{stats['real_tokens']} ({100 * stats['real_fraction']:.2f}%)"),
        (
            "supervised tokens",
            f"{stats['supervised_tokens']} ({100 * stats['supervised_fraction']:.2f}%)",
        ),
        *(
            [
                (
                    "images (distinct)",
                    f"{stats['images']} ({stats['distinct_images']}): {stats['image_tokens']} "
                    f"image tokens, {stats['image_patch_bytes'] / 2**20:.1f} MiB of patches",
                )
            ]
            if "images" in stats
            else []
        ),
        *([("images above 8 bits", _above_8_bit(stats))] if "images_above_8_bit" in stats else []),
        (
            "packs with no sample of 128+ tokens",
            stats.get("packs_without_128_window", ""),
        ),
        *(
            (
                f"source {k + 1}",
                f"{src['path']} ({src['format']}, weight {src['weight']:g}): {src['samples']} "
                f"samples, {src['tokens']} tokens, {src['supervised_tokens']} supervised",
            )
            for k, src in enumerate(stats.get("sources", []))
        ),
        ("build / load seconds", f"{stats['build_seconds']:.2f} / {stats['load_seconds']:.2f}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)

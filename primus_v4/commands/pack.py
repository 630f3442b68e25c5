"""`primus-v4 pack`: tokenize a corpus, pack it into THD rows, cache it node-locally, report stats.

Imports stay inside `run` so that `primus-v4 pack` on a cache hit never imports torch (and
`datasets` only when a hub corpus is built).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        required=True,
        action="append",
        help="corpus: a .json/.jsonl/.parquet file or a directory of them, a hub dataset "
        "name[@revision], or synthetic[:rows=N,seed=S] (the embedded Alpaca-like corpus). "
        "Repeat to mix sources; options after '::', e.g. "
        "'chat.jsonl::weight=3,format=sharegpt' or 'org/name::split=train,subset=en'",
    )
    parser.add_argument(
        "--format",
        default="auto",
        choices=("messages", "sharegpt", "alpaca", "prompt_completion", "auto"),
        help="row shape of every source without its own format= (default: detected, logged)",
    )
    parser.add_argument(
        "--chat-mode",
        default="auto",
        choices=("chat", "thinking", "auto"),
        help="DeepSeek-V4 rendering: chat (</think> opens each answer), thinking (<think>, "
        "reasoning rendered) or auto (thinking for rows with reasoning_content; default)",
    )
    parser.add_argument(
        "--chat-format",
        default="auto",
        choices=("auto", "v4", "v4-0731", "v4.1"),
        help="conversation format, rendered by DeepSeek's deepseek-recipe: v4, v4-0731 (0731's "
        "reasoning-effort texts), v4.1; auto (default): the release's config.json beside the "
        "tokenizer (--tokenizer), else V4.1 when the tokenizer has <｜System｜>, else v4",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the draws for fractional source weights"
    )
    parser.add_argument(
        "--seq-length", type=int, required=True, help="tokens per pack (the training row length)"
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="node-local cache dir (default $PRIMUS_PACK_CACHE_DIR, else $PRIMUS_LOCAL_ROOT/packs "
        "with PRIMUS_LOCAL_ROOT defaulting to $TMPDIR/primus_v4-UID: the one train and the "
        "recipes read)",
    )
    parser.add_argument(
        "--algorithm",
        default="ffd",
        choices=("ffd", "bfd"),
        help="packer: first-fit-decreasing (default) or best-fit-decreasing; both deterministic",
    )
    parser.add_argument(
        "--overlong",
        default="truncate",
        choices=("truncate", "drop"),
        help="samples longer than --seq-length: cut them (default) or leave them out",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="dir with tokenizer.json (default: DeepSeek-V4's)"
    )
    parser.add_argument(
        "--stats-json", type=Path, default=None, help="also write the statistics to this JSON file"
    )
    parser.add_argument(
        "--export-jsonl", type=Path, default=None, help="write one pack per line (integer lists)"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="a bad row, or a picture of more than 8 bits per channel, is an error naming its "
        "file and line",
    )
    parser.add_argument(
        "--special-tokens-in-text",
        choices=("keep", "warn", "error"),
        default="warn",
        help="special-token text inside message content (it encodes as the special token): "
        "counted, and kept silently, warned about (default) or refused",
    )
    parser.add_argument(
        "--lock-dir",
        default=None,
        help="node-local lock dir (default $PRIMUS_PACK_LOCK_DIR, else $PRIMUS_LOCAL_ROOT/locks)",
    )
    parser.add_argument(
        "--lock-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for another process building the same packs (default 600)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def parse_data_args(items: list[str]) -> str | list[dict[str, Any]]:
    """`--data PATH[::key=value,...]` (repeatable) -> one path, or a list of source mappings."""
    from primus_v4.errors import DataError

    if len(items) == 1 and "::" not in items[0]:
        return items[0]
    sources: list[dict[str, Any]] = []
    for item in items:
        path, _, options = item.partition("::")
        source: dict[str, Any] = {"path": path}
        for option in filter(None, (o.strip() for o in options.split(","))):
            key, sep, value = option.partition("=")
            if not sep or key not in ("format", "weight", "split", "subset"):
                raise DataError(
                    f"--data {item!r}: bad option {option!r}; expected format=, weight=, split= "
                    "or subset="
                )
            try:
                source[key] = float(value) if key == "weight" else value
            except ValueError:
                raise DataError(f"--data {item!r}: weight {value!r} is not a number") from None
        sources.append(source)
    return sources


def _inputs(data: str | list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """What pack reads, by the option that names it: no output may be one of them."""
    paths = [data] if isinstance(data, str) else [s["path"] for s in data]
    which = (lambda k: "") if len(paths) == 1 else (lambda k: f" #{k + 1}")
    found: dict[str, Any] = {f"the corpus (--data{which(k)})": p for k, p in enumerate(paths)}
    found.update({"the tokenizer (--tokenizer)": args.tokenizer,
                  "the pack cache (--cache-dir)": args.cache_dir})  # fmt: skip
    return found


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Create `path`'s parent; an OSError inside is one error naming `path` (written atomically,
    so nothing partial is left)."""
    from primus_v4.errors import describe_os_error

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield
    except OSError as exc:
        raise describe_os_error(exc, "cannot write", where=path) from exc


def run(args: argparse.Namespace) -> int:
    from primus_v4.data.pipeline import PackSpec, build_or_load
    from primus_v4.data.stats_table import summary_table
    from primus_v4.durable import overlap_problem, writable_problem, write_durable
    from primus_v4.errors import PathError

    data = parse_data_args(args.data)
    spec = PackSpec(
        data=data,
        format=args.format,
        chat_mode=args.chat_mode,
        chat_format=args.chat_format,
        seed=args.seed,
        seq_length=args.seq_length,
        algorithm=args.algorithm,
        overlong=args.overlong,
        tokenizer=args.tokenizer,
        strict=args.strict,
        special_tokens_in_text=args.special_tokens_in_text,
        cache_dir=args.cache_dir,
        lock_dir=args.lock_dir,
        lock_timeout_s=args.lock_timeout,
    )
    inputs = _inputs(data, args)
    for flag, path in (("--stats-json", args.stats_json), ("--export-jsonl", args.export_jsonl)):
        problem = None if path is None else writable_problem(path.parent)
        if problem is not None:  # before the packing pass, not after it
            raise PathError(f"{flag} {path}: {problem}")
        clash = None if path is None else overlap_problem(path, inputs)
        if clash is not None:
            raise PathError(f"{flag} {path}: {clash}; write it elsewhere (pack never writes over "
                            "what it reads)")  # fmt: skip
        inputs[flag] = path
    corpus = build_or_load(spec, progress=False if args.no_progress else None)  # bars on a tty
    if args.stats_json is not None:
        with _writing(args.stats_json):
            write_durable(args.stats_json, json.dumps(corpus.stats, indent=2) + "\n")
    if args.export_jsonl is not None:
        with _writing(args.export_jsonl):
            corpus.export_jsonl(args.export_jsonl)
    print(f"primus-v4 pack: {spec.describe()} at seq_length {args.seq_length} ({args.algorithm})")
    print(summary_table(corpus.stats))
    return 0

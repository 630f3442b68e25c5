"""`primus-v4 inspect <view>`: read-only views. Each view registers in `VIEWS` with its own
`add_arguments(parser)` and `run(args) -> int`; add a view (model, config, ...) by adding an entry.
Views import what they need inside `run`, so listing a cache never imports torch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dir",
        nargs="?",
        default=None,
        help="pack cache dir (default $PRIMUS_PACK_CACHE_DIR, else $PRIMUS_LOCAL_ROOT/packs with "
        "PRIMUS_LOCAL_ROOT defaulting to $TMPDIR/primus_v4-UID; with --config: the config's)",
    )
    parser.add_argument(
        "--cache-dir", default=None, help="the pack cache dir, as `primus-v4 pack` takes it"
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE_OR_NAME",
        help="a run config (as `train --config` takes it): mark the entries its training and "
        "evaluation data would load, and say which it would build; default dir: the config's",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="with --config: override one config value, as `train --set` does",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check every file against its manifest sha256; exit 1 when an entry is CORRUPT",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per entry")


def _wanted(args: argparse.Namespace) -> dict[str, dict]:
    """--config: the entries its run reads, by role ({role: {dir, key, hit}}); else nothing."""
    from primus_v4.config import load_config
    from primus_v4.config.resolve import pack_spec
    from primus_v4.data.pipeline import cache_lookup
    from primus_v4.errors import UsageError

    if args.config is None:
        if args.overrides:
            raise UsageError("--set needs --config (the run config it overrides)")
        return {}
    cfg = load_config(args.config, args.overrides)
    wanted = {"data.path": cache_lookup(pack_spec(cfg))}
    if cfg.data.eval_path or cfg.data.eval_fraction > 0:
        wanted["evaluation"] = cache_lookup(pack_spec(cfg, split="eval"))
    return wanted


def _cache_run(args: argparse.Namespace) -> int:
    from primus_v4.data import cache
    from primus_v4.errors import DataError

    if args.dir and args.cache_dir and Path(args.dir) != Path(args.cache_dir):
        raise DataError(f"two cache dirs given ({args.dir} and --cache-dir {args.cache_dir}); "
                        "pass one")  # fmt: skip
    wanted = _wanted(args)
    given = args.cache_dir or args.dir
    if given is None and wanted:
        given = wanted["data.path"]["dir"]
    root = Path(given).expanduser() if given else cache.default_cache_dir()
    roles = {w["key"]: role for role, w in wanted.items() if Path(w["dir"]) == root}
    if not root.is_dir() and (root.exists() or not wanted):
        what = "is not a directory" if root.exists() else "does not exist"
        raise DataError(f"pack cache dir {root} {what}")
    entries = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if not path.is_dir():
            continue
        if path.name.startswith(".tmp-pack-"):
            entries.append({"entry": path.name, "status": "incomplete (temp of a build)"})
            continue
        if not path.name.startswith("pack-"):
            continue
        entries.append(_describe(path, verify=args.verify))
        if entries[-1].get("key") in roles:
            entries[-1]["used_by"] = roles[entries[-1]["key"]]
    corrupt = any(str(e["status"]).startswith("CORRUPT") for e in entries)
    if args.json:
        for item in entries:
            print(json.dumps(item))
        for role, w in wanted.items():
            print(json.dumps({"config": args.config, "role": role, **w}))
        return 1 if corrupt else 0
    print(f"{root}: {sum(1 for e in entries if 'key' in e)} pack cache entries")
    for item in entries:
        if "key" not in item:
            print(f"  {item['entry']}: {item['status']}")
            continue
        used = f"  <- {item['used_by']}" if "used_by" in item else ""
        print(
            f"  {item['key']}  {item['status']:<10} {item['bytes'] / 2**20:8.1f} MiB  "
            f"seq={item['seq_length']} {item['algorithm']} packs={item['num_packs']} "
            f"samples={item['num_samples']} real={100 * item['real_fraction']:.1f}% "
            f"supervised={100 * item['supervised_fraction']:.1f}%"
            + (f" images={item['images']}" if item["images"] else "")
            + f"  data={item['data']}{used}"
        )
    for role, w in wanted.items():
        found = "hit: the run loads it" if w["hit"] else "miss: the run builds it"
        print(f"config {args.config}, {role}: key {w['key']} in {w['dir']}: "
              f"{found}")  # fmt: skip
    return 1 if corrupt else 0


# Stats that describe one `pack` call rather than the cache entry.
_PER_CALL_STATS = ("cache_key", "cache_hit", "build_seconds")


def _describe(path: Path, *, verify: bool) -> dict:
    from primus_v4.data import cache
    from primus_v4.data.pipeline import STATS_KEYS

    key = path.name.removeprefix("pack-")
    try:
        manifest = cache.check_manifest(cache.read_manifest(path), path)
    except (OSError, ValueError) as exc:
        return {"entry": path.name, "status": f"invalid: no readable manifest ({exc})"}
    except cache.CacheInvalid as exc:  # under --verify a damage like any other
        return {"entry": path.name, "status": f"{'CORRUPT' if verify else 'invalid'}: {exc}"}
    status = "ok" if not verify else "verified"
    if verify:
        from primus_v4.data.pipeline import image_files_changed

        try:
            cache.verify(path, key)
            changed = image_files_changed(manifest)
            if changed is not None:  # the files are sound; the next load rebuilds it
                status = f"stale ({changed}; the next load rebuilds it)"
        except cache.CacheInvalid as exc:
            status = f"CORRUPT ({exc})"
    stats, fields = manifest["stats"], manifest["key_fields"]
    return {
        "key": key,
        "status": status,
        "bytes": cache.dir_bytes(path),
        "data": manifest.get("data"),
        "seq_length": manifest["seq_length"],
        "algorithm": fields.get("algorithm"),
        "key_fields": fields,
        **{k: stats.get(k) for k in STATS_KEYS if k not in _PER_CALL_STATS},
        "images": stats.get("images", 0),
    }


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("preset", help="model preset name (`primus-v4 inspect presets` lists them)")
    parser.add_argument("--json", action="store_true", help="print the counts as one JSON object")


def _model_run(args: argparse.Namespace) -> int:
    from primus_v4.models import preset_spec

    spec = preset_spec(args.preset)
    cfg = spec.config_class.preset(args.preset)
    counts = spec.param_counts(cfg)
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    if args.json:
        print(json.dumps({"preset": args.preset, "layer_kinds": kinds, **counts}))
        return 0
    print(
        f"{args.preset}: {cfg.num_layers} layers ({kinds.count('dense')} dense, "
        f"{kinds.count('csa')} CSA, {kinds.count('hca')} HCA) + {cfg.mtp_num_layers} MTP, "
        f"hidden {cfg.hidden_size}, {cfg.num_moe_experts} experts top-{cfg.moe_router_topk}"
    )
    for name, value in counts.items():
        print(f"  {name:<20} {value:>20,}")
    return 0


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--section", default=None, help="only this section's keys (data, model, parallel, ...)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per key")


def _config_run(args: argparse.Namespace) -> int:
    from primus_v4.config.reference import format_reference, reference
    from primus_v4.config.schema import SECTIONS
    from primus_v4.errors import UsageError

    if args.section is not None and args.section not in SECTIONS:  # checked here, so that
        # `primus-v4 --help` does not import the config schema
        raise UsageError(f"--section: invalid choice: {args.section!r} (choose from "
                         f"{', '.join(SECTIONS)})")  # fmt: skip
    if args.json:
        for entry in reference():
            if args.section in (None, entry["key"].partition(".")[0]):
                print(json.dumps(entry, default=str))
        return 0
    print(format_reference(args.section))
    return 0


def _presets_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _presets_run(args: argparse.Namespace) -> int:
    from primus_v4.config.loader import RUNS_DIR, bundled_run_configs
    from primus_v4.models import PRESET_DIR
    from primus_v4.models import presets as model_presets

    presets = sorted(model_presets())
    runs = bundled_run_configs()
    if args.json:
        print(json.dumps({"model_presets": presets, "run_configs": runs}))
        return 0
    print(f"model presets (model.preset=NAME; files in {PRESET_DIR}):")
    print("".join(f"  {name}\n" for name in presets), end="")
    print(f"run configs (train --config NAME; files in {RUNS_DIR}):")
    print("".join(f"  {name}\n" for name in runs), end="")
    return 0


def _checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dir", help="a checkpoint.dir (every checkpoint in it) or one step_NNNNNNNN checkpoint"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check every file's size and sha256 against the checkpoint's manifest, as resume "
        "and export do; exit 1 when a checkpoint is damaged (without --verify only the marker, "
        "the model layout and the manifest's presence are checked)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per checkpoint")


def _checkpoint_run(args: argparse.Namespace) -> int:
    from primus_v4.errors import CheckpointError

    root = Path(args.dir).expanduser()
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise CheckpointError(f"checkpoint dir {root} {what}")
    dirs = [root] if root.name.startswith("step_") else sorted(root.glob("step_*"))
    dirs += sorted(root.glob(".tmp_step_*"))
    bad = False
    for path in dirs:
        item = _checkpoint_entry(path, verify=args.verify)
        bad |= bool(item["problems"])
        if args.json:
            print(json.dumps(item))
            continue
        print(f"{path}: {item['status']}, {item['bytes'] / 2**20:.1f} MiB, {item['files']} files")
        for problem in item["problems"]:
            print(f"  {problem}")
    if not dirs and not args.json:
        print(f"{root}: no checkpoints")
    return 1 if bad else 0


def _checkpoint_entry(path: Path, *, verify: bool) -> dict:
    from primus_v4.data.cache import dir_bytes
    from primus_v4.training.checkpoint import integrity

    files = sum(1 for p in path.rglob("*") if p.is_file())
    if not integrity.is_complete(path):
        status, problems = "incomplete (a save that did not finish; never loaded)", []
    else:  # the check resume and export make; without --verify the data files are not hashed
        problems = integrity.problems(path) if verify else integrity.quick_problems(path)
        status = "DAMAGED" if problems else ("verified" if verify else "complete")
    return {"checkpoint": str(path), "status": status, "problems": problems,
            "bytes": dir_bytes(path), "files": files}  # fmt: skip


def _memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="run config YAML (default: built-in)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value (repeatable)")  # fmt: skip
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks of the run (default WORLD_SIZE or 1)")  # fmt: skip
    parser.add_argument("--device-memory", default="MI300X",
                        help="GiB per device, or MI300X / MI308X (192) / MI355X (288)")  # fmt: skip
    parser.add_argument("--supervised-fraction", type=_fraction, default=1.0,
                        help="rows that reach the LM head (default 1: the worst)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="one JSON object per stage")


def _fraction(text: str) -> float:
    """A share in [0, 1] (nan and inf refused): argparse's usage error names the option."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction between 0 and 1")
    return value


def _memory_run(args: argparse.Namespace) -> int:
    from primus_v4.config import load_config, resolve_run
    from primus_v4.errors import OverMemoryError
    from primus_v4.memory.gate import MemoryPlanError, check_fits, parse_device, report
    from primus_v4.memory.plan import plan_memory

    device, gib = parse_device(args.device_memory)
    run = resolve_run(load_config(args.config, overrides=args.set), world=args.world_size)
    plans = plan_memory(run, device_gb=gib, supervised_fraction=args.supervised_fraction)
    if args.json:
        for p in plans:
            print(json.dumps({"stage": p.stage, "device_bytes": p.device_total,
                              "host_bytes": p.host_total, "rows": p.rows}))  # fmt: skip
    else:
        print(report(run, plans, device, gib))
    try:  # the launch gate's check and line; a script can tell a plan that fits by the status
        check_fits(plans, device=device, gib=gib, ignore=False)
    except MemoryPlanError as exc:
        raise OverMemoryError(str(exc)) from None
    return 0


def _draft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="RELEASE_OR_RUN_DIR",
                        help="a release directory with its drafter (a run's export, or a "
                        "DeepSeek-V4.1 release), or a training run / checkpoint dir (exported "
                        "first as released, into a temporary directory)")  # fmt: skip
    parser.add_argument("--release", default=None, metavar="DIR",
                        help="for a training run: where the release it started from is now (a "
                        "copy of its model.pretrained, which the export reads)")  # fmt: skip
    parser.add_argument("--data", default=None,
                        help="conversations (any format `pack` reads), tokenized with the "
                        "release's tokenizer; default for a training run: its held-out rows "
                        "(data.eval_path, else its data.eval_fraction split of data.path, in its "
                        "chat format), for a release: the default config's data.path")  # fmt: skip
    parser.add_argument("--prompt-ids", default=None, metavar="JSONL",
                        help="prompts already tokenized: one JSON list of token ids per line "
                        "(instead of --data)")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=16,
                        help="the first N samples' prompts are measured (default 16)")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="tokens generated per prompt (default 32)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _prompts(corpus: Any, count: int) -> list[list[int]]:
    """The prompt of each sample, in corpus order: its tokens through the row whose next token
    is the first supervised one (a sample with no supervised token is skipped)."""
    out: list[list[int]] = []
    for i in range(len(corpus)):
        batch = corpus.thd_batch(i)
        cu = batch.cu_seqlens_N1.tolist()
        for lo, hi in itertools.pairwise(cu):
            supervised = batch.loss_mask_S[lo:hi].nonzero().flatten()
            if len(supervised) and not bool(batch.padding_mask_S[lo]):
                out.append(batch.input_ids_S[lo : lo + int(supervised[0]) + 1].tolist())
            if len(out) == count:
                return out
    return out


def _prompt_ids(path: Path, count: int) -> list[list[int]]:
    """The first `count` prompts of a JSONL file of token-id lists (each at least 2 ids)."""
    from primus_v4.errors import DataError

    out: list[list[int]] = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)
            except ValueError:
                ids = None
            ok = isinstance(ids, list) and len(ids) >= 2
            if not ok or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise DataError(f"--prompt-ids {path} line {number}: expected a JSON list of at "
                                "least 2 token ids (non-negative integers)")  # fmt: skip
            out.append(ids)
            if len(out) == count:
                break
    if not out:
        raise DataError(f"--prompt-ids {path}: no prompt")
    return out


def _held_out(model: str, run: Any) -> Any:
    """What a training run's evaluation packs (data.eval_path, or the data.eval_fraction split
    of data.path), in its tokenizer and chat format; refused when the run held out no row."""
    from primus_v4.config.resolve import pack_spec
    from primus_v4.errors import ConfigError

    if not run.data.eval_path and not run.data.eval_fraction:
        raise ConfigError(f"--model {model}: the run held out no rows (data.eval_fraction is 0 "
                          "and data.eval_path is unset): pass --data or --prompt-ids")  # fmt: skip
    return pack_spec(run, split="eval")


def _draft_run(args: argparse.Namespace) -> int:
    import tempfile

    from primus_v4.config import load_config
    from primus_v4.config.resolve import pack_spec
    from primus_v4.data.pipeline import build_or_load
    from primus_v4.errors import ConfigError
    from primus_v4.models import release_spec

    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise ConfigError("--num-prompts and --max-new-tokens must be >= 1")
    held_out = None  # a training run's held-out rows, as its evaluation packs them
    with tempfile.TemporaryDirectory(prefix="primus-v4-draft-") as tmp:
        release = Path(args.model)
        if not (release / "config.json").is_file():  # a training run: export it as released
            from primus_v4.export.run import export_checkpoint, find_source, with_release

            source = with_release(find_source(args.model), args.release)
            if args.data is None and args.prompt_ids is None:
                held_out = _held_out(args.model, source.run)
            release = Path(tmp) / "release"
            export_checkpoint(source, release, dtype="fp8")
        elif args.release is not None:
            raise ConfigError(f"--release {args.release}: --model {args.model} is a release "
                              "already (--release names the release a training run started "
                              "from)")  # fmt: skip
        spec = release_spec(release)
        if spec.speculate is None:
            raise ConfigError(f"--model {args.model}: {spec.title} releases carry no drafter "
                              "this measures (DeepSeek-V4.1's DSpark)")  # fmt: skip
        if args.prompt_ids is not None:
            if args.data is not None:
                raise ConfigError("--data and --prompt-ids: give one of them")
            prompts = _prompt_ids(Path(args.prompt_ids), args.num_prompts)
        else:
            items = [f"model.pretrained={release}", "data.eval_fraction=0"]
            items += [f"data.path={args.data}"] if args.data else []
            corpus = build_or_load(held_out or pack_spec(load_config(overrides=items)))
            prompts = _prompts(corpus, args.num_prompts)
            if not prompts:
                what = "its held-out rows" if held_out else f"--data {args.data}"
                raise ConfigError(f"{what}: no sample with a supervised response")
        report = spec.speculate(release, prompts, max_new_tokens=args.max_new_tokens,
                                progress=sys.stderr.isatty())  # fmt: skip
    source = (f"--prompt-ids {args.prompt_ids}" if args.prompt_ids else
              f"--data {args.data}" if args.data else
              f"the run's held-out rows of {held_out.data}" if held_out else
              "the default data.path")  # fmt: skip
    numbers = {"model": str(args.model), "prompts_from": source, **report.as_dict()}
    if args.json:
        print(json.dumps(numbers))
        return 0
    n, new, block = numbers["prompts"], numbers["max_new_tokens"], numbers["block_size"]
    print(f"{args.model}: greedy speculative decoding of {n} prompts ({source}), {new} new "
          f"tokens each, blocks of {block}")  # fmt: skip
    print(f"  mean accepted draft tokens per block  {numbers['mean_accepted']:.3f}")
    print(f"  tokens per backbone pass              {numbers['tokens_per_block']:.3f}")
    print(f"  draft share of generated tokens       {numbers['draft_share']:.3f}")
    return 0


def _kernels_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default=None,
                        help="a backend for every op or op=backend entries, as "
                        "PRIMUS_V4_KERNEL_BACKEND (default: that variable, else auto)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="one JSON object per op")


def _kernels_run(args: argparse.Namespace) -> int:
    import os

    import torch

    from primus_v4 import kernels
    from primus_v4.environment import kernel_spec_problems
    from primus_v4.errors import ConfigError
    from primus_v4.kernels import registry

    before = os.environ.get(registry.ENV_VAR)
    problems = kernel_spec_problems(args.backend or "", source="--backend")
    if problems:
        raise ConfigError("; ".join(problems))
    if args.backend is not None:  # the variable's syntax, so per-op entries work here too
        os.environ[registry.ENV_VAR] = args.backend
    rows, failed = [], False
    try:
        for op in kernels.available_ops():
            try:
                c = kernels.choose(op)
                rows.append({"op": op, "wanted": c.wanted, "chosen": c.chosen,
                             "order": c.order, "refused": c.refused})  # fmt: skip
            except ConfigError as exc:
                failed = True
                rows.append({"op": op, "wanted": "?", "chosen": None, "order": (),
                             "refused": {"error": str(exc)}})  # fmt: skip
        spec = os.environ.get(registry.ENV_VAR, "") or "auto"
    finally:
        if before is None:
            os.environ.pop(registry.ENV_VAR, None)
        else:
            os.environ[registry.ENV_VAR] = before
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 1 if failed else 0
    if registry.has_gpu():
        props = torch.cuda.get_device_properties(0)
        arch = getattr(props, "gcnArchName", "") or f"sm_{props.major}{props.minor}"
        where = f"GPU {props.name} ({arch.split(':')[0]})"
    else:
        where = "no GPU (CPU)"
    print(f"kernel backends: {where}; {registry.ENV_VAR}={spec}; "
          f"auto order on GPUs: {', '.join(registry.AUTO_ORDER)}")  # fmt: skip
    print(f"  {'op':<18} {'backend':<13} refused (why)")
    for row in rows:
        chosen = " -> ".join(row["order"]) if row["order"] else "ERROR"
        reasons = [f"{b}: {why}" for b, why in row["refused"].items()] or ["-"]
        print(f"  {row['op']:<18} {chosen:<13} {reasons[0]}")
        for reason in reasons[1:]:
            print(f"  {'':<18} {'':<13} {reason}")
    return 1 if failed else 0


# view name -> (help, add_arguments, run)
VIEWS: dict[
    str,
    tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]],
] = {
    "config": (
        "the config reference: every key with its type, default and meaning",
        _config_arguments,
        _config_run,
    ),
    "presets": ("the shipped model presets and run configs", _presets_arguments, _presets_run),
    "model": ("parameter counts of a model preset by component", _model_arguments, _model_run),
    "cache": ("list pack cache entries: key, stats, size", _cache_arguments, _cache_run),
    "checkpoint": (
        "list training checkpoints; --verify checks their checksums",
        _checkpoint_arguments,
        _checkpoint_run,
    ),
    "memory": ("per-rank memory plan of a run before launch", _memory_arguments, _memory_run),
    "draft": (
        "how well a release's or run's drafter speculates: greedy speculative decoding of "
        "held-out prompts (mean accepted draft tokens per block, draft share)",
        _draft_arguments,
        _draft_run,
    ),
    "kernels": (
        "the kernel backend each op uses here, and why each other one is refused",
        _kernels_arguments,
        _kernels_run,
    ),
}


DESCRIPTION = "Read-only views; nothing is changed. `primus-v4 inspect VIEW --help` for a view."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    views = parser.add_subparsers(dest="view", required=True, metavar="VIEW", title="views")
    for name, (help_text, add, _) in VIEWS.items():
        add(views.add_parser(name, help=help_text, description=help_text))


def run(args: argparse.Namespace) -> int:
    return VIEWS[args.view][2](args)

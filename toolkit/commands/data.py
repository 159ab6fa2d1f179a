"""`toolkit data prepare --config RECIPE [key=value ...]` (a recipe's data tokenized into its
prepared cache ahead of the job, on every core) and `toolkit data inspect DIR` (what a prepared
cache holds)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("data", help="prepare a recipe's data ahead of a job, or inspect prepared data")
    commands = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    prepare = commands.add_parser(
        "prepare", help="tokenize a recipe's data into its prepared cache and check it, as the run would",
        description="Reads the recipe (and key=value overrides) as recipes/finetune.py does, tokenizes every "
                    "data source not prepared yet into data.cache_dir/prepared (default RUN_DIR/data_cache) with "
                    "data.num_proc processes (default: every core), and runs the start's data checks. A job with "
                    "the same data settings then opens the cache instead of tokenizing.")
    prepare.add_argument("--config", required=True, help="the recipe YAML")
    prepare.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. data.seq_len=4096")
    prepare.set_defaults(func=_prepare)
    inspect = commands.add_parser("inspect", help="rows, tokens, key fields and counts of prepared data",
                                  description="DIR: a prepared directory, or data.cache_dir (or its prepared/).")
    inspect.add_argument("dir")
    inspect.add_argument("--verify", action="store_true", help="check every array's BLAKE3 digest (reads every byte)")
    inspect.add_argument("--json", action="store_true", help="print the description as JSON")
    inspect.set_defaults(func=_inspect)


def _prepare(args) -> int:
    from toolkit.train.recipe_data import prepare_for_recipe

    cfg, rows = prepare_for_recipe(args.config, args.overrides)
    unit = "pairs" if cfg.method == "dpo" else "packed rows" if cfg.data.pack else "samples"
    valid = f"; validation {len(rows.valid):,} {unit}" if rows.valid is not None else ""
    print(f"data ready: {len(rows.train):,} {unit} ({rows.stats.tokens:,} tokens read) from {cfg.data.train_file}"
          f"{valid}; every check passed")
    return 0


def _inspect(args) -> int:
    import json

    from toolkit.train.prepared_info import describe, lines

    info = describe(args.dir, verify=args.verify)
    print(json.dumps(info, indent=2) if args.json else "\n".join(lines(info)))
    return 0

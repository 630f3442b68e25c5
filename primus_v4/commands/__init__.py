"""One module per CLI subcommand, each with `add_arguments(parser)` and `run(args) -> int`.

A subcommand imports what it runs inside `run`, so `primus-v4 --help`, `pack` and `inspect
config` start without loading torch or the model.
"""

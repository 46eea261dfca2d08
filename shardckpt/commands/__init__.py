"""One module per CLI subcommand; ``shardckpt/cli.py`` wires them into the app."""

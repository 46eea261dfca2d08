"""``python -m shardckpt`` (and ``torchrun -m shardckpt``) runs the CLI."""

from shardckpt.cli import main

if __name__ == "__main__":
    main()

"""torch_checkpointing's ``CheckpointManager`` directories: ``metadata.pkl`` and per-rank item files."""

"""Infrastructure: errors, the source-file gate, DST's lock and staging, signals, the launch runtime.

The lowest layer: it knows files, processes and ranks, nothing of checkpoints.
"""

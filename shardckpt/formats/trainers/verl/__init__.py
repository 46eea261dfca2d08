"""veRL's ``FSDPCheckpointManager`` directories, FSDP2 (``verl``) and FSDP1 (``verl-fsdp1``): read, and written at M.

Its ``Format`` entries are in ``formats/trainers/__init__.py``.
"""

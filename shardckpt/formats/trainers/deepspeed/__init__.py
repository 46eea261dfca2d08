"""DeepSpeed ZeRO checkpoints as a source: a save (``deepspeed``, ``deepspeed-module``) and
``ds_to_universal``'s output (``deepspeed-universal``), read without DeepSpeed.

Their ``Format`` entries are in ``formats/trainers/__init__.py``; nothing here imports
the readers (``torch_save`` uses ``lone_file``, which must load without them).
"""

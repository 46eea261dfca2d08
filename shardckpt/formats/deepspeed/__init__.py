"""DeepSpeed ZeRO checkpoints as a source: a save (``deepspeed``, ``deepspeed-module``) and
``ds_to_universal``'s output (``deepspeed-universal``), read without DeepSpeed.

Imports nothing: ``torch_file`` uses ``lone_file``, which must load without the readers.
"""

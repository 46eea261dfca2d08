"""``megatron``: megatron-core ``dist_checkpointing`` directories saved with the ``torch_dist`` backend.

Read (``reader.py``) as one tree, the DCP data and ``common.pt``'s values; written at
any world size M (``writer.py``) as a directory ``dist_checkpointing.load`` takes.
``inspect`` says what each chunk is (``layouts.py``): stacked layers, tensor-parallel
pieces. Detected by its ``common.pt`` or ``metadata.json`` beside DCP's ``.metadata``
(``config.py``). Its ``Format`` is in ``formats/trainers/__init__.py``.
"""

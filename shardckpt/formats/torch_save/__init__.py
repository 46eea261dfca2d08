"""One ``torch.save`` file (``.pt``, ``.pth``, ``.bin``): memory-mapped reads, a skeleton filled in place."""

from __future__ import annotations

from shardckpt.formats.format import Format, Ref

TORCH = Format(
    name="torch",
    layout="full",
    title="torch",
    reader=Ref("shardckpt.formats.torch_save.file:TorchReader"),
    writer=Ref("shardckpt.formats.torch_save.file:TorchWriter"),
    directory=False,
    detect=Ref("shardckpt.formats.torch_save.file:is_torch_file"),
    suffixes=(".pt", ".pth", ".bin"),
    default_for="full",
    model_root=True,
)

FORMATS = (TORCH,)

"""Bytes on disk below any format: ``torch.save`` zips laid out before their data, pickles
read as opcodes, typed JSON for plain values, a tensor's raw bytes."""

"""A DCP ``.metadata`` is unpickled with Python's cycle collector held off, and kept out of its walks while it lives."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardckpt.core.collector import collector_paused
from shardckpt.formats.dcp import reader


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_off_inside_and_as_it_was_after_even_on_an_error(enabled):
    (gc.enable if enabled else gc.disable)()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("inside")
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_metadata_is_unpickled_with_the_collector_off(tmp_path, monkeypatch):
    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path, no_dist=True)
    seen = []
    real = reader._MetadataUnpickler.load

    def spy(self):
        seen.append(gc.isenabled())
        return real(self)

    monkeypatch.setattr(reader._MetadataUnpickler, "load", spy)
    gc.unfreeze()
    md = reader.read_metadata(tmp_path, trust_pickle=False)
    assert "w" in md.state_dict_metadata
    assert seen == [False]
    assert gc.isenabled()
    # Its objects are left out of the collector's walks while it lives, and no longer.
    frozen = gc.get_freeze_count()
    assert frozen > 0
    del md
    gc.collect()
    assert gc.get_freeze_count() < frozen

"""Every output format, at M = 1, 3, 8 and 64, is byte-identical to what the code wrote before
issue 21 rewrote how outputs are framed (``tests/goldens/outputs``: the SHA-256 of every
file, as ``make.py`` recorded them at commit 36814c5, per torch release).

The source is a real FSDP2 checkpoint (``tests/reference.make_fsdp2_dcp``), committed so that
each run converts the same bytes; each case converts it standalone, as ``shardckpt convert``
does. That the bytes do not depend on the launch size is ``test_identical_outputs.py``'s.
"""

from __future__ import annotations

from dataclasses import replace

import output_goldens
import pytest
import reference  # noqa: F401  (makes examples/make_checkpoint.py importable for --model)
from rank_bytes import file_hashes

from shardckpt import api

CASES = output_goldens.cases()


@pytest.fixture(scope="module")
def goldens() -> dict[str, dict[str, str]]:
    """Return this torch release's recorded hashes; skip where none were recorded."""
    release = output_goldens.torch_release()
    hashes = output_goldens.recorded().get(release)
    if hashes is None:
        pytest.skip(
            f"no golden outputs recorded for torch {release}: record them with "
            "tests/goldens/outputs/make.py and the pinned code (its README)"
        )
    return hashes


def test_every_output_format_has_goldens_at_every_world_size():
    recorded = output_goldens.recorded()
    assert set(recorded) >= {"2.13.0", "2.15.0"}
    for release, hashes in recorded.items():
        assert set(hashes) == set(CASES), release
    assert {"dcp-M1", "dcp-M64", "fsdp1-local-M3", "fsdp2-ranks-M64", "hf"} <= set(CASES)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_the_output_is_byte_identical_to_the_golden(goldens, tmp_path, case):
    request = CASES[case]
    dst = tmp_path / request.dst
    api.convert(replace(request, dst=dst))
    assert file_hashes(dst) == goldens[case]

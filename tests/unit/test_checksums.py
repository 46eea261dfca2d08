"""The ledger of what was read: pieces CRC'd once, merged, chained across processes, judged."""

from __future__ import annotations

import os
import zlib

import torch

from shardckpt.state.checksums import Ledger, Written, checked, checking, judge, merged, next_gap

DATA = os.urandom(1000)
CRC = zlib.crc32(DATA)


def written(crcs=(CRC, CRC)) -> Written:
    return Written("f", 100, len(DATA), crcs, "record 'archive/data/0' at byte 100")


def ledger_with(*pieces: tuple[int, int], crcs=(CRC, CRC)) -> Ledger:
    """Return a ledger that read ``DATA[a:b]`` for each piece, in the order given."""
    ledger = Ledger()
    ledger.expect(written(crcs), ["model.w"])
    for a, b in pieces:
        ledger.note("f", 100, a, DATA[a:b])
    return ledger


def test_pieces_read_out_of_order_and_overlapping_are_crcd_once_each_byte():
    ledger = ledger_with((500, 1000), (0, 300), (200, 600), (250, 260))
    (seen,) = ledger.seen()
    assert [(a, n) for a, n, _ in seen.spans] == [(0, 300), (300, 200), (500, 500)]
    assert all(crc == zlib.crc32(DATA[a : a + n]) for a, n, crc in seen.spans)
    verdict = judge([ledger.seen()])
    assert (verdict.damaged, verdict.whole, verdict.partial, verdict.bytes) == ((), 1, 0, 1000)


def test_a_record_read_in_part_is_not_judged():
    verdict = judge([ledger_with((0, 999)).seen()])
    assert (verdict.damaged, verdict.whole, verdict.partial) == ((), 0, 1)


def test_spans_of_two_processes_that_overlap_chain_where_their_boundaries_meet():
    one, two = ledger_with((0, 600)), ledger_with((600, 1000), (200, 800))
    verdict = judge([one.seen(), two.seen()])
    assert (verdict.damaged, verdict.whole) == ((), 1)


def test_spans_that_overlap_without_a_shared_boundary_leave_the_record_unjudged():
    one, two = ledger_with((0, 600)), ledger_with((400, 1000))
    assert judge([one.seen(), two.seen()]).partial == 1


def test_a_flipped_byte_is_damage_naming_the_tensors_and_the_record():
    ledger = Ledger()
    ledger.expect(written(), ["model.w", "model.tied"])
    flipped = bytearray(DATA)
    flipped[700] ^= 1
    ledger.note("f", 100, 0, bytes(flipped))
    (damage,) = judge([ledger.seen()]).damaged
    assert damage.crc == zlib.crc32(bytes(flipped))
    assert damage.message() == (
        "the bytes of 'model.w' and 'model.tied' do not match the checksum written with them "
        "(record 'archive/data/0' at byte 100)"
    )


def test_copies_of_the_checksum_that_disagree_are_damage():
    ledger = ledger_with((0, 1000), crcs=(CRC, CRC ^ 1))
    assert len(judge([ledger.seen()]).damaged) == 1


def test_bytes_of_a_span_nobody_expects_are_not_kept():
    ledger = Ledger()
    ledger.note("f", 100, 0, DATA)
    assert ledger.seen() == []


def test_a_view_of_a_mapped_storage_is_noted_at_its_offset_only_inside_checking(tmp_path):
    file = tmp_path / "f"
    file.write_bytes(bytes(100) + DATA)
    storage = torch.frombuffer(bytearray(DATA), dtype=torch.uint8).untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    assert checked(whole) is whole  # no command running: nothing to note into
    with checking() as ledger:
        ledger.expect(Written(str(file), 100, len(DATA), (CRC, CRC), "record 'w'"), ["model.w"])
        ledger.map_storage(storage, (str(file), 100))
        # Read from the file, not through the mapping (a file cut short must not fault).
        tail, head = checked(whole[600:]), checked(whole[:600])
        assert bytes(tail.numpy()) + bytes(head.numpy()) == DATA[600:] + DATA[:600]
    verdict = judge([ledger.seen()])
    assert (verdict.damaged, verdict.whole) == ((), 1)


def test_shardckpt_checksums_0_turns_the_checks_off(monkeypatch):
    monkeypatch.setenv("SHARDCKPT_CHECKSUMS", "0")
    storage = torch.frombuffer(bytearray(DATA), dtype=torch.uint8).untyped_storage()
    with checking() as ledger:
        ledger.expect(written(), ["model.w"])
        ledger.map_storage(storage, ("f", 100))
        checked(torch.empty(0, dtype=torch.uint8).set_(storage))
    assert ledger.seen() == []


def test_the_gap_to_read_runs_from_where_the_chain_stops_to_the_next_span():
    assert next_gap([(0, 10, 0), (10, 20, 0)], 30) is None
    assert next_gap([(0, 10, 0), (10, 20, 0)], 32) == (30, 32)  # padding nobody read
    assert next_gap([(0, 60, 0), (40, 60, 0)], 100) == (60, 100)  # overlap, no shared boundary
    assert next_gap([(20, 10, 0)], 30) == (0, 20)


def test_one_process_alone_merges_as_it_would_beside_a_process_that_read_nothing():
    ledger = Ledger()
    for n, start in enumerate([900, 100, 500]):
        span = Written("g" if n == 1 else "f", start, 300, (1, 1), f"record {n}")
        ledger.expect(span, [f"w{n}", f"v{n}"])
        ledger.note(span.file, start, 200, DATA[:100])
        ledger.note(span.file, start, 0, DATA[:150])
    alone = merged([ledger.seen()])
    assert alone == merged([ledger.seen(), []])
    assert [s.written.key for s in alone] == [("f", 500), ("f", 900), ("g", 100)]
    assert all(
        s.spans == ((0, 150, zlib.crc32(DATA[:150])), (200, 100, zlib.crc32(DATA[:100])))
        for s in alone
    )

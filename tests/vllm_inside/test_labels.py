"""The label tables on their own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mori.plugin_channel.labels import LabelTable


def test_default_label_is_busy_and_labels_only_demote() -> None:
    t = LabelTable()
    assert t.label_of_block(5) == "busy"  # no program
    t.learn("a", [5])
    assert t.label_of_block(5) == "busy"  # a program without a label
    assert t.set_labels({"a": "inactive"}) == {5}
    assert t.label_of_block(5) == "inactive"
    t.learn("z", [5])  # an unlabelled program shares it: back to busy
    assert t.label_of_block(5) == "busy"


def test_most_protective_label_wins() -> None:
    t = LabelTable()
    t.learn("a", [1, 2])
    t.learn("b", [2])
    t.set_labels({"a": "inactive", "b": "idle"})
    assert (t.label_of_block(1), t.label_of_block(2)) == ("inactive", "idle")
    t.set_labels({"a": "busy"})
    assert t.label_of_block(2) == "busy"


def test_cold_protects_above_inactive_below_idle() -> None:
    t = LabelTable()
    t.learn("a", [1, 2])
    t.learn("b", [2, 3])
    t.learn("c", [3])
    t.set_labels({"a": "inactive", "b": "cold", "c": "idle"})
    assert [t.label_of_block(b) for b in (1, 2, 3)] == ["inactive", "cold", "idle"]
    with pytest.raises(ValueError, match="not one of"):
        t.set_labels({"a": "frozen"})


def test_replace_and_clear_report_every_changed_program() -> None:
    t = LabelTable()
    t.learn("a", [1])
    t.learn("b", [2])
    t.learn("c", [3])
    t.set_labels({"a": "idle", "b": "inactive"})
    # a: idle -> busy (set explicitly), b: forgotten (inactive -> busy), c: busy -> idle
    assert t.replace({"a": "busy", "c": "idle"}) == {1, 2, 3}
    assert t.labels() == {"a": "busy", "c": "idle"}
    assert t.clear() == {3}
    with pytest.raises(ValueError):
        t.replace({"a": "sleepy"})
    assert t.labels() == {}


def test_tables_are_bounded() -> None:
    t = LabelTable(max_programs=2, max_programs_per_block=2)
    t.learn("a", [1])
    t.set_labels({"a": "inactive", "b": "idle"})
    assert t.set_labels({"c": "idle"}) == {1}  # a's label is forgotten: its block changes
    assert t.labels() == {"b": "idle", "c": "idle"}
    t.learn("b", [9])
    t.learn("c", [9])
    t.learn("d", [9])  # a third program: the block is widely shared, kept busy
    assert t.label_of_block(9) == "busy"
    t.forget_block(9)
    assert t.programs_of(9) == frozenset() and t.blocks_of("b") == frozenset()


def test_drop() -> None:
    t = LabelTable()
    blocks = [SimpleNamespace(block_id=i, ref_cnt=0, block_hash=b"h") for i in range(6)]
    blocks[2].ref_cnt = 1  # held by a running request
    blocks[4].block_hash = None  # not cached
    t.learn("a", [1, 2, 3, 4])
    t.learn("b", [3])
    t.set_labels({"a": "idle", "b": "inactive"})
    evict, affected = t.drop("a", blocks)
    assert evict == {1} and affected == {1, 2, 3, 4}
    assert t.label_of_block(3) == "inactive" and t.labels() == {"b": "inactive"}
    assert t.blocks_of("a") == frozenset()


def test_held_counts_cached_blocks_and_labelled_lists_a_label() -> None:
    t = LabelTable()
    t.learn("a", [1, 2, 3])
    t.learn("b", [3, 4])
    t.set_labels({"a": "idle", "b": "inactive", "c": "inactive"})
    assert t.held(lambda b: b != 2) == {"a": 2, "b": 2}
    assert t.held(lambda b: b > 3) == {"b": 1}  # a program with nothing cached is left out
    assert sorted(t.labelled("inactive")) == ["b", "c"] and t.labelled("busy") == []


def test_held_is_safe_while_another_thread_changes_the_table() -> None:
    """The label server reads ``held`` on its thread while the scheduler learns blocks."""
    import threading

    t = LabelTable()
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        i = 0
        while not stop.is_set():
            t.learn(f"p{i % 500}", range(i % 97, i % 97 + 5))
            t.forget_block(i % 101)
            t.set_labels({f"p{i % 500}": "idle"})
            i += 1

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(300):
            try:
                held = t.held(lambda b: True)
                t.labelled("idle")
            except BaseException as e:  # what the server's thread must never see
                errors.append(e)
                break
            assert all(n > 0 for n in held.values())
    finally:
        stop.set()
        worker.join()
    assert not errors, errors

"""MORI's eviction order for SGLang's radix tree (``mori.sglang_plugin.order``): no SGLang
needed. The same order on SGLang's own classes is tested in tests/sglang_inside."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mori.plugin_channel.labels import LabelTable
from mori.sglang_plugin.order import (
    MAX_OWNERS,
    WIDE,
    add_owner,
    eviction_key,
    node_class,
    program_of,
    routing_key,
)


def table(**labels: str) -> LabelTable:
    t = LabelTable()
    t.set_labels(labels)
    return t


def test_device_order_unowned_inactive_idle_busy_then_lru() -> None:
    labels = table(a="busy", b="idle", c="inactive")
    nodes = {"busy-old": ({"a"}, 1.0), "idle": ({"b"}, 2.0), "inactive": ({"c"}, 3.0),
             "unowned": (set(), 4.0), "idle-older": ({"b"}, 0.5)}
    order = sorted(nodes, key=lambda n: eviction_key(nodes[n][0], nodes[n][1], labels))
    assert order == ["unowned", "inactive", "idle-older", "idle", "busy-old"]


def test_host_order_keeps_the_idle_copies_last() -> None:
    labels = table(a="busy", b="idle", c="inactive")
    nodes = {"busy": ({"a"}, 3.0), "idle": ({"b"}, 1.0), "inactive": ({"c"}, 2.0),
             "unowned": (set(), 4.0)}
    order = sorted(nodes, key=lambda n: eviction_key(nodes[n][0], nodes[n][1], labels,
                                                     host=True))
    assert order == ["unowned", "inactive", "busy", "idle"]


def test_shared_nodes_take_the_most_protective_label() -> None:
    labels = table(a="inactive", b="idle", c="busy")
    assert node_class({"a", "b"}, labels) == "idle"
    assert node_class({"a", "c"}, labels) == "busy"
    assert node_class({"a", "unlabelled"}, labels) == "busy"  # unknown = busy, as in vLLM
    assert node_class(set(), labels) == "unowned"


def test_without_labels_every_node_is_plain_lru() -> None:
    empty = LabelTable()
    assert eviction_key({"a"}, 5.0, empty) == eviction_key(set(), 5.0, empty) == (0, 5.0)


def test_widely_shared_nodes_count_as_busy() -> None:
    owners: set[str] = set()
    for i in range(MAX_OWNERS):
        add_owner(owners, f"p{i}")
    assert len(owners) == MAX_OWNERS
    add_owner(owners, "one-more")
    assert owners == {WIDE}
    assert node_class(owners, table(p1="inactive")) == "busy"


@given(st.text(min_size=1, max_size=40))
def test_any_program_id_survives_the_routing_header(program: str) -> None:
    key = routing_key(program)
    assert key.isascii() and " " not in key and "\n" not in key
    assert program_of(key) == program


def test_no_routing_key_no_program() -> None:
    assert program_of(None) is None and program_of("") is None

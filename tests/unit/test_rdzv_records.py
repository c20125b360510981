"""The closed-record parser every agent runs on every round's membership: its fast path must accept exactly
what parse_node accepts, and say the same thing about what it rejects."""

from __future__ import annotations

import json

import pytest

from nvrx.launcher.agent.rdzv_records import BadRecord, NodeInfo, parse_closed, parse_node, parse_nodes


def closed(nodes: list) -> str:
    return json.dumps({"round": 3, "restart_count": 1, "nodes": nodes})


def test_closed_record_members_come_back_as_node_infos_in_order() -> None:
    rec = parse_closed(closed([{"node_id": "b", "addr": "10.0.0.2", "nproc": 8},
                               {"node_id": "a", "addr": "10.0.0.1", "nproc": 4}]))
    assert rec["nodes"] == (NodeInfo("b", "10.0.0.2", 8), NodeInfo("a", "10.0.0.1", 4))
    assert rec["nodes"][1].nproc == 4 and rec["nodes"][0]._asdict() == {"node_id": "b", "addr": "10.0.0.2", "nproc": 8}


@pytest.mark.parametrize("node", [
    1, [], "n", {"addr": "x", "nproc": 1}, {"node_id": "", "addr": "x", "nproc": 1},
    {"node_id": "n", "addr": 5, "nproc": 1}, {"node_id": "n", "addr": "x", "nproc": True},
    {"node_id": "n", "addr": "x", "nproc": 0}, {"node_id": "n" * 513, "addr": "x", "nproc": 1},
    {"node_id": "n", "addr": "x", "nproc": 1.0},
])
def test_a_bad_member_is_rejected_as_parse_node_words_it(node: object) -> None:
    with pytest.raises(BadRecord) as single:
        parse_node(node)
    with pytest.raises(BadRecord) as fast:
        parse_nodes([{"node_id": "ok", "addr": "10.0.0.1", "nproc": 1}, node])
    assert str(fast.value) == str(single.value)
    with pytest.raises(BadRecord):
        parse_closed(closed([node]))


def test_a_member_listed_twice_is_rejected() -> None:
    node = {"node_id": "a", "addr": "10.0.0.1", "nproc": 1}
    with pytest.raises(BadRecord, match="listed twice"):
        parse_closed(closed([node, node]))

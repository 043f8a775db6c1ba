"""A program's agent as the gateway tracks it (``mori.gateway.agents.AgentTrack``): its
tool calls' lengths, measured on the wire, and the predicted length of the pending one
against what it turned out to be."""

from __future__ import annotations

from mori.core.returns import ReturnConfig, ReturnPredictor
from mori.gateway.agents import RECENT_TOOL_CALLS, AgentTrack, RequestFacts, StepFacts

RESULTS = RequestFacts(agent="claude-code", tool_results=True)


def test_a_tool_calls_length_error_and_history() -> None:
    predictor = ReturnPredictor(ReturnConfig(rule="tools", min_tool=1, prior_s=5.0))
    a, b = AgentTrack(agent="claude-code"), AgentTrack(agent="claude-code")
    # a's Bash call: nothing known, so the prior; it takes 2 s
    a.ended(StepFacts(tool_names=("Bash",)), wall=10.0)
    a.expected_tool_s = predictor.expect_s(a.recent, a.pending_tools, a.agent)
    assert a.expected_tool_s == 5.0
    tools = a.pending_tools
    took = a.arrived(RESULTS, wall=12.0)
    assert took == 2.0 and a.last_tool_error_s == 3.0 and list(a.recent) == [2.0]
    assert a.expected_tool_s is None and not a.in_tool
    predictor.observe(took, tools, a.agent)
    # b's Bash call is predicted from a's
    b.ended(StepFacts(tool_names=("Bash",)), wall=20.0)
    assert predictor.expect_s(b.recent, b.pending_tools, b.agent) == 2.0
    row = a.as_dict()
    assert row["last_tool_error_s"] == 3.0 and row["expected_tool_s"] is None


def test_a_request_without_tool_results_ends_no_call_and_forgets_the_prediction() -> None:
    a = AgentTrack()
    a.ended(StepFacts(tool_names=("Bash",)), wall=0.0)
    a.expected_tool_s = 4.0
    assert a.arrived(RequestFacts(tool_results=False), wall=1.0) is None
    assert a.last_tool_error_s is None and a.expected_tool_s is None and not a.recent


def test_only_the_last_calls_are_the_programs_own_history() -> None:
    a = AgentTrack()
    for k in range(RECENT_TOOL_CALLS + 2):
        a.ended(StepFacts(tool_names=("Read",)), wall=10.0 * k)
        a.arrived(RESULTS, wall=10.0 * k + k)
    assert list(a.recent) == [float(k) for k in range(2, RECENT_TOOL_CALLS + 2)]

"""Tests that drive the real agent CLIs (Claude Code, Codex) against a local endpoint.

``clis`` installs the pinned CLIs (``scripts/agent_clis.sh``) and builds the offline
environment and command line of each; docs/agents-wire.md says what they send.
"""

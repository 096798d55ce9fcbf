"""Agents written with the frameworks people already use, reaching their principal through the gateway (issue 16).

Each module is an optional extra: ``integrations.langgraph`` needs ``.[langgraph]``,
``integrations.openai_agents`` needs ``.[openai-agents]``. They import only
``subjects/`` and ``pgwcore/`` of this project (docs/architecture.md).
"""

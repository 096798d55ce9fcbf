"""Agents from the frameworks people already use (issue 16).

Each integration speaks the bus only through ``subjects/`` (the contract and
its ``Agent`` client) and the platform in ``pgwcore/``; it imports nothing
from ``gateway/`` or ``consumers/``. The frameworks themselves are optional
extras (``pip install '.[mcp]'``, ``'.[langgraph]'``, ``'.[openai-agents]'``), imported only by the module that needs
them. See docs/integrations.md.
"""

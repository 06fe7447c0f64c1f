"""Framework adapters: each turns a framework's tool call into a gate check, and a verdict into the framework's action.

- ``clef_guard.integrations.langchain``: ``GuardMiddleware`` for ``create_agent``.
- ``clef_guard.integrations.langgraph``: ``guarded_tool_node``, ``guard_node``, ``intent_router``.
- ``clef_guard.integrations.callbacks``: ``GuardCallbackHandler`` for chains without middleware.
"""

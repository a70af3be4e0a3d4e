"""Process-wide state: the detected topology and the chosen engine.

``init()`` is the one entry point; everything that needs an engine before it
raises ``NotInitializedError``.
"""

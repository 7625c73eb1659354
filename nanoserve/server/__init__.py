"""The OpenAI-compatible HTTP front end. Imports the engine's public API, never the runner.

Not imported by `import nanoserve`: the offline API needs no web stack.
"""

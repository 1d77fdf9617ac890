"""The engine: model runner, request loop and the vLLM-shaped public API."""

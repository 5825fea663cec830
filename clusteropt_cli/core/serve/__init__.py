"""copt serve: the continuous-batching engine (engine.py), its model runner, and the OpenAI-compatible server."""

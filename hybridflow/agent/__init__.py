"""Multi-turn agent loop: tools, sandbox, parsers and the rollout loop."""

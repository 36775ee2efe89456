"""Command-line tools that read an experiment config without starting anything (e.g. memory_plan)."""

"""Serving engine, scheduler and OpenAI-compatible HTTP API (selfspec.serve)."""

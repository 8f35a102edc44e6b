"""Training of draft heads (selfspec.train)."""

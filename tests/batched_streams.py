"""Run several generation streams to the end with each round's trees verified in one forward,
as the server's engine does (``selfspec.batched_verify``), for tests."""

from __future__ import annotations

import torch

from selfspec.batched_verify import verify_features
from selfspec.generation import GenerationStream


def run_batched(streams: list[GenerationStream]) -> None:
    """Start every stream, then round by round draft each unfinished one (trees sized for the
    shared forward), verify them all in one target forward and conclude each."""
    for stream in streams:
        stream.start()
    target = streams[0].owner.target
    while active := [s for s in streams if not s.done]:
        drafted = [s.draft(len(active)) for s in active]
        with torch.inference_mode():
            features = verify_features(
                target, [(s.state, d) for s, d in zip(active, drafted, strict=True)]
            )
        for stream, step, rows in zip(active, drafted, features, strict=True):
            stream.conclude(step, rows)

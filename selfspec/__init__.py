"""selfspec: self-speculative decoding with draft heads trained once, reused across LoRA adapters.

The core (this package) holds the model math and the decoding loop; the wings
``selfspec.train``, ``selfspec.adapters`` and ``selfspec.serve`` build on it and are never
imported from here.
"""

from selfspec.generation import (
    FinishReason,
    GenerationConfig,
    GenerationResult,
    GenerationStream,
    SpeculativeGenerator,
    StepOutput,
)
from selfspec.heads import (
    HeadKind,
    HeadsConfig,
    build_heads,
    heads_config_for,
    load_heads,
    save_heads,
)
from selfspec.sampling import SamplingParams
from selfspec.stats import GenerationStats
from selfspec.target import LoadedTarget, TargetSpec, apply_chat_template, load_target
from selfspec.tree import (
    DEFAULT_STATIC_TREE,
    DraftSampling,
    DynamicTree,
    StaticTree,
    parse_tree_spec,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_STATIC_TREE",
    "DraftSampling",
    "DynamicTree",
    "FinishReason",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "HeadKind",
    "HeadsConfig",
    "LoadedTarget",
    "SamplingParams",
    "SpeculativeGenerator",
    "StaticTree",
    "StepOutput",
    "TargetSpec",
    "apply_chat_template",
    "build_heads",
    "heads_config_for",
    "load_heads",
    "load_target",
    "parse_tree_spec",
    "save_heads",
]

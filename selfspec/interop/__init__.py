"""Draft heads in other projects' checkpoint formats.

``speculators`` (the format vLLM loads; its EAGLE-3 drafters are SpecForge's with renamed layers)
for EAGLE-3 heads, both ways; FasterDecoding's Medusa layout, into selfspec. Each format module is
pure functions from one config + state dict to another; ``convert`` reads and writes the
directories; ``selfspec export`` / ``selfspec import`` are the commands (``selfspec.cli_interop``).
"""

from selfspec.interop.convert import export_speculators, import_medusa, import_speculators
from selfspec.interop.errors import InteropError

__all__ = ["InteropError", "export_speculators", "import_medusa", "import_speculators"]

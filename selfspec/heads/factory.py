"""Build heads sized for a given target."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from selfspec.heads.config import HeadKind, HeadsConfig
from selfspec.heads.eagle import EagleHead
from selfspec.heads.medusa import MedusaHeads

DraftHeads = MedusaHeads | EagleHead


def heads_config_for(
    model: PreTrainedModel, kind: HeadKind | str, **overrides: object
) -> HeadsConfig:
    """A HeadsConfig whose sizes match the target; other fields from ``overrides``."""
    embed = model.get_input_embeddings().weight  # [vocab, H]
    hidden = int(embed.shape[1])
    fields: dict[str, object] = {
        "kind": HeadKind(kind),
        "hidden_size": hidden,
        "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
    }
    heads = getattr(model.config, "num_attention_heads", None) or getattr(model.config, "n_head", 0)
    if heads and hidden % heads == 0:
        fields["num_attention_heads"] = int(heads)
    theta = (getattr(model.config, "rope_parameters", None) or {}).get("rope_theta")
    if theta:
        fields["rope_theta"] = float(theta)
    fields.update(overrides)
    return HeadsConfig(**fields)  # type: ignore[arg-type]


def build_heads(config: HeadsConfig) -> DraftHeads:
    if config.kind is HeadKind.MEDUSA:
        return MedusaHeads(config)
    return EagleHead(config)


def is_heads_module(module: nn.Module) -> bool:
    return isinstance(module, MedusaHeads | EagleHead)

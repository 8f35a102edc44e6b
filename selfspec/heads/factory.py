"""Build heads sized for a given target: the kinds' classes come from the registry."""

from __future__ import annotations

from transformers import PreTrainedModel

# The head modules register their classes on import; the factory is what imports them all.
from selfspec.heads import eagle, eagle3, medusa  # noqa: F401
from selfspec.heads.config import HeadKind, HeadsConfig, default_target_layers
from selfspec.heads.eagle import EagleHead
from selfspec.heads.eagle3 import Eagle3Head
from selfspec.heads.medusa import MedusaHeads
from selfspec.heads.registry import heads_class, is_heads_module

__all__ = ["DraftHeads", "build_heads", "heads_config_for", "is_heads_module"]

DraftHeads = MedusaHeads | EagleHead | Eagle3Head


def heads_config_for(
    model: PreTrainedModel, kind: HeadKind | str, **overrides: object
) -> HeadsConfig:
    """A HeadsConfig whose sizes match the target; other fields from ``overrides``.

    EAGLE-3 heads also take the target's attention layout (query and key/value heads), MLP width
    and norm epsilon, as the published drafters do, and fuse the default low/mid/high layers
    (``default_target_layers``) unless ``target_layers`` is given."""
    kind = HeadKind(kind)
    embed = model.get_input_embeddings().weight  # [vocab, H]
    hidden = int(embed.shape[1])
    config = model.config
    fields: dict[str, object] = {
        "kind": kind,
        "hidden_size": hidden,
        "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
    }
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 0)
    if heads and hidden % heads == 0:
        fields["num_attention_heads"] = int(heads)
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    if theta:
        fields["rope_theta"] = float(theta)
    if kind is HeadKind.EAGLE3:
        fields.update(_eagle3_fields(config, int(fields.get("num_attention_heads", 0))))
    fields.update(overrides)
    if fields.get("target_layers") is not None:
        fields["target_layers"] = tuple(fields["target_layers"])  # type: ignore[arg-type]
    config = HeadsConfig(**fields)  # type: ignore[arg-type]
    layers = _num_layers(model.config)
    if config.target_layers and max(config.target_layers) > layers:
        raise ValueError(
            f"target_layers {list(config.target_layers)} reach past the target's {layers} "
            f"decoder layers (0..{layers}: indices of its output_hidden_states)"
        )
    return config


def _num_layers(config: object) -> int:
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if not layers:
        raise ValueError("the target's config names no layer count (num_hidden_layers / n_layer)")
    return int(layers)


def _eagle3_fields(config: object, heads: int) -> dict[str, object]:
    fields: dict[str, object] = {"target_layers": default_target_layers(_num_layers(config))}
    kv_heads = getattr(config, "num_key_value_heads", None)
    if heads and kv_heads and heads % int(kv_heads) == 0:
        fields["num_key_value_heads"] = int(kv_heads)
    mlp = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    if mlp:
        fields["intermediate_size"] = int(mlp)
    eps = getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_epsilon", None)
    if eps:
        fields["norm_eps"] = float(eps)
    return fields


def build_heads(config: HeadsConfig) -> DraftHeads:
    return heads_class(config.kind)(config)  # type: ignore[return-value]

"""EAGLE-3 heads in the ``speculators`` format, the one vLLM loads (checked against 0.9.0).

A speculators EAGLE-3 drafter is a directory of ``config.json``, a speculators
``Eagle3SpeculatorConfig``:

- ``speculators_model_type: "eagle3"``;
- ``transformer_layer_config``: its one decoder layer, described as a Llama config (sizes,
  attention heads, ``rope_parameters``, ``rms_norm_eps``, the target's vocabulary size);
- ``draft_vocab_size`` and ``eagle_aux_hidden_state_layer_ids`` (the fused target layers: index k
  is the residual stream entering decoder layer k, selfspec's ``target_layers``);
- ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``: variants of the
  layer, all false for the EAGLE-3 of the paper and of selfspec;
- ``speculators_config``: the proposal method (``greedy``, ``speculative_tokens``, which vLLM
  takes as its default draft length) and the ``verifier`` (``name_or_path``, ``architectures``);

and of ``model.safetensors`` with SpecForge's tensor names except that the decoder layer is
``layers.0.*`` where SpecForge and selfspec say ``midlayer.*``; ``d2t`` / ``t2d`` are there only
when the draft vocabulary is smaller than the target's. The drafter's token embedding is the
target's: speculators saves a copy (``embed_tokens.weight``) and its loader needs it there (without
it, under transformers 5.x, the embedding is left uninitialised rather than fetched from the
verifier); vLLM shares the target's in any case. selfspec heads never store one: an export adds
the base's when the base is given, an imported copy must equal the base's.

Exported configs carry a ``selfspec`` field (the heads config, the base fingerprint, the heads'
extra record), which speculators keeps as an extra field and an import reads back. Every
variant selfspec cannot compute exactly is refused by name, never approximated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaConfig

from selfspec.heads.config import HeadKind, HeadsConfig
from selfspec.heads.draft_vocab import check_draft_vocab
from selfspec.interop.errors import InteropError

SPECULATORS_VERSION = "0.9.0"
"""The speculators release this format follows (``scripts/interop_speculators.sh`` checks it)."""
MODEL_TYPE = "eagle3"
SELFSPEC_FIELD = "selfspec"
LAYER, SELFSPEC_LAYER = "layers.0.", "midlayer."  # speculators' / SpecForge's and selfspec's
EMBEDDING = "embed_tokens.weight"
TRAINING_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")
VARIANT_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
SPECULATORS_TYPES = ("eagle3", "peagle", "mtp", "dflash", "dflash2", "dspark", "xpress")
"""speculators 0.9.0's drafter types: none of them is Medusa, and EAGLE-1 ("eagle") is gone."""


@dataclass(frozen=True)
class Verifier:
    """The base (speculators: verifier) a drafter was made for."""

    name_or_path: str | None
    """HF id or local path that loaders use to find the base; None when unknown."""
    architectures: tuple[str, ...]
    """HF architecture names, e.g. ("LlamaForCausalLM",)."""
    max_position_embeddings: int | None = None
    """The base's context length (vLLM sizes the drafter's rotary table by it); None: unknown."""


@dataclass(frozen=True)
class SpeculatorsDrafter:
    """What an imported config.json says."""

    heads: HeadsConfig
    verifier: Verifier
    speculative_tokens: int | None
    speculators_version: str | None
    record: dict[str, Any]
    """The ``selfspec`` field of a config selfspec exported; empty otherwise."""


# -- export --------------------------------------------------------------------------------------


def check_exportable(heads: HeadsConfig) -> None:
    """Raise `InteropError` unless ``heads`` have an exact speculators counterpart."""
    if heads.kind is HeadKind.MEDUSA:
        raise InteropError(
            "Medusa heads cannot be exported in the speculators format: it has no Medusa type "
            f"(speculators {SPECULATORS_VERSION} defines {', '.join(SPECULATORS_TYPES)}); "
            "selfspec exports EAGLE-3 heads"
        )
    if heads.kind is HeadKind.EAGLE:
        raise InteropError(
            "selfspec's EAGLE heads cannot be exported in the speculators format: their decoder "
            "layer normalises its fused input (attn_norm), where speculators' EAGLE-1 layout "
            "(type 'eagle', speculators <= 0.4; since removed, and not a type vLLM reads) has "
            "no norm there or adds two more (layernorms=true). No weights reproduce the drafts, "
            "so nothing is written; train EAGLE-3 heads (kind eagle3) to export"
        )
    layers = list(heads.target_layers)
    if len(set(layers)) != len(layers):
        raise InteropError(
            f"EAGLE-3 heads fusing target layers {layers} cannot be exported: speculators "
            "requires distinct eagle_aux_hidden_state_layer_ids"
        )


def export_config(
    heads: HeadsConfig,
    verifier: Verifier,
    speculative_tokens: int,
    record: dict[str, Any],
) -> dict[str, Any]:
    """config.json of the speculators drafter equal to ``heads``; ``record`` is kept in the
    ``selfspec`` field."""
    check_exportable(heads)
    if speculative_tokens < 1:
        raise InteropError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config(heads, verifier.max_position_embeddings),
        "draft_vocab_size": heads.draft_rows,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(heads.target_layers),
        # Written out: vLLM reads a missing norm_before_residual as true, speculators as false.
        **dict.fromkeys(VARIANT_FLAGS, False),
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier.name_or_path,
                "architectures": list(verifier.architectures),
            },
        },
        SELFSPEC_FIELD: record,
    }


def layer_config(heads: HeadsConfig, max_positions: int | None) -> dict[str, Any]:
    """The decoder layer of EAGLE-3 ``heads`` as a Llama config (``transformer_layer_config``)."""
    theta = float(heads.rope_theta)
    layer: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": heads.vocab_size,
        "hidden_size": heads.hidden_size,
        "intermediate_size": heads.mlp_size,
        "num_hidden_layers": 1,
        "num_attention_heads": heads.num_attention_heads,
        "num_key_value_heads": heads.kv_heads,
        "head_dim": heads.hidden_size // heads.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": heads.norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, 4.x (older vLLM) rope_theta.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    if max_positions is not None:
        layer["max_position_embeddings"] = int(max_positions)
    return layer


def export_tensors(heads: HeadsConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """selfspec EAGLE-3 state -> speculators tensors: ``midlayer.`` becomes ``layers.0.``; the
    vocabulary maps only with a draft vocabulary (speculators has none for the whole one)."""
    check_exportable(heads)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in ("d2t", "t2d"):
            if heads.draft_vocab_size:
                tensors[name] = tensor.detach().cpu().contiguous()
            continue
        if name.startswith(SELFSPEC_LAYER):
            name = LAYER + name[len(SELFSPEC_LAYER) :]
        tensors[name] = tensor.detach().to("cpu", torch.float32).contiguous()
    return tensors


# -- import --------------------------------------------------------------------------------------


def import_config(data: dict[str, Any], what: str, base_layers: int) -> SpeculatorsDrafter:
    """Read a speculators config.json; ``base_layers``: decoder layers of the base, for the
    default fused layers when the config names none. Raise `InteropError` on anything that does
    not map exactly onto selfspec's EAGLE-3 heads."""
    model_type = data.get("speculators_model_type")
    if model_type is None:
        raise InteropError(
            f"{what}: config.json has no speculators_model_type; not a speculators checkpoint"
        )
    if model_type != MODEL_TYPE:
        hint = (
            " (EAGLE-1: selfspec's EAGLE layer normalises its fused input, speculators' does not)"
            if model_type == "eagle"
            else ""
        )
        raise InteropError(
            f"{what}: speculators_model_type is {model_type!r}; selfspec imports "
            f"{MODEL_TYPE!r} drafters only{hint}"
        )
    layer = _llama_layer(data.get("transformer_layer_config"), what)
    hidden, vocab = int(layer.hidden_size), int(layer.vocab_size)
    for flag in VARIANT_FLAGS:
        if flag not in data and flag == "norm_before_residual":
            raise InteropError(
                f"{what}: config.json does not say norm_before_residual (speculators reads it "
                "as false, vLLM as true); add it"
            )
        if data.get(flag, False) is not False:
            raise InteropError(
                f"{what}: {flag}={data[flag]!r}; selfspec's EAGLE-3 layer is the variant with "
                f"{', '.join(VARIANT_FLAGS)} all false"
            )
    target_hidden = data.get("target_hidden_size")
    if target_hidden not in (None, hidden):
        raise InteropError(
            f"{what}: target_hidden_size={target_hidden} differs from the layer's hidden_size="
            f"{hidden}; selfspec's heads read a target of their own width"
        )
    draft_vocab = _int_field(data, "draft_vocab_size", what)
    if not 1 <= draft_vocab <= vocab:
        raise InteropError(f"{what}: draft_vocab_size={draft_vocab} must be in [1, {vocab}]")
    fields = {
        "kind": HeadKind.EAGLE3,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "num_layers": 1,
        "num_attention_heads": int(layer.num_attention_heads),
        "num_key_value_heads": int(layer.num_key_value_heads or layer.num_attention_heads),
        "intermediate_size": int(layer.intermediate_size),
        "rope_theta": float(layer.rope_parameters["rope_theta"]),
        "norm_eps": float(layer.rms_norm_eps),
        "draft_vocab_size": 0 if draft_vocab == vocab else draft_vocab,
        "target_layers": tuple(_aux_layers(data, base_layers, what)),
    }
    try:
        heads = HeadsConfig(**fields)  # type: ignore[arg-type]
    except ValueError as error:
        raise InteropError(f"{what}: {error}") from error
    record = data.get(SELFSPEC_FIELD) or {}
    if not isinstance(record, dict):
        raise InteropError(f"{what}: the {SELFSPEC_FIELD} field must be an object")
    return SpeculatorsDrafter(
        heads=_recorded_heads(record, heads, what),
        verifier=_verifier(data, layer, what),
        speculative_tokens=_speculative_tokens(data),
        speculators_version=data.get("speculators_version"),
        record=record,
    )


def _llama_layer(layer: object, what: str) -> LlamaConfig:
    """``transformer_layer_config`` read as speculators reads it (a transformers config of its
    model_type), checked to be the plain Llama layer selfspec computes."""
    if not isinstance(layer, dict):
        raise InteropError(
            f"{what}: transformer_layer_config must be a JSON object (the drafter's decoder "
            f"layer as a HF config), got {type(layer).__name__}"
        )
    if layer.get("model_type") != "llama":
        raise InteropError(
            f"{what}: transformer_layer_config.model_type is {layer.get('model_type')!r}; "
            "selfspec's EAGLE-3 layer is a Llama layer ('llama'; speculators reads a missing "
            "model_type as 'qwen3', whose attention adds q/k norms)"
        )
    missing = [
        key
        for key in ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size")
        if key not in layer
    ]
    if missing:
        raise InteropError(f"{what}: transformer_layer_config lacks {missing}")
    given = {k: v for k, v in layer.items() if k not in ("model_type", "transformers_version")}
    try:
        config = LlamaConfig(**given)
    except Exception as error:  # transformers' strict dataclass errors are not ValueErrors
        raise InteropError(f"{what}: transformer_layer_config is invalid: {error}") from error
    rope = dict(config.rope_parameters or {})
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    problems = [
        (config.num_hidden_layers != 1, f"num_hidden_layers={config.num_hidden_layers} (1)"),
        (config.hidden_act != "silu", f"hidden_act={config.hidden_act!r} ('silu')"),
        (bool(config.attention_bias), "attention_bias=true (false)"),
        (bool(config.mlp_bias), "mlp_bias=true (false)"),
        (
            head_dim * config.num_attention_heads != config.hidden_size,
            f"head_dim={head_dim} x {config.num_attention_heads} heads != hidden_size="
            f"{config.hidden_size} (equal)",
        ),
        (
            rope.get("rope_type", "default") != "default",
            f"rope_type={rope.get('rope_type')!r} ('default')",
        ),
        (
            rope.get("partial_rotary_factor", 1.0) != 1.0,
            f"partial_rotary_factor={rope.get('partial_rotary_factor')} (1.0)",
        ),
    ]
    found = [text for bad, text in problems if bad]
    if found:
        raise InteropError(
            f"{what}: transformer_layer_config has {'; '.join(found)} — selfspec's EAGLE-3 layer "
            "needs the values in parentheses"
        )
    return config


def _int_field(data: dict[str, Any], key: str, what: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InteropError(f"{what}: config.json needs an integer {key}, got {value!r}")
    return value


def _aux_layers(data: dict[str, Any], base_layers: int, what: str) -> list[int]:
    """The fused layers; when the config names none, speculators' default (2, L//2, L-3)."""
    layers = data.get("eagle_aux_hidden_state_layer_ids")
    if layers is None:
        layers = [2, base_layers // 2, base_layers - 3]
        source = f"the default for a {base_layers}-layer base"
    else:
        source = "eagle_aux_hidden_state_layer_ids"
    if (
        not isinstance(layers, list)
        or not layers
        or any(isinstance(k, bool) or not isinstance(k, int) for k in layers)
        or min(layers) < 0
        or max(layers) > base_layers
        or len(set(layers)) != len(layers)
    ):
        raise InteropError(
            f"{what}: {source} {layers!r} must be distinct layer indices in [0, {base_layers}] "
            "of the base"
        )
    return layers


def _recorded_heads(record: dict[str, Any], derived: HeadsConfig, what: str) -> HeadsConfig:
    """The heads config selfspec exported, when it describes the same drafter as the speculators
    fields (it restores fields speculators has no place for); else the derived one."""
    if "heads" not in record:
        return derived
    try:
        recorded = HeadsConfig.from_dict(record["heads"])
    except (TypeError, ValueError) as error:
        raise InteropError(f"{what}: {SELFSPEC_FIELD}.heads is invalid: {error}") from error
    if recorded.kind is not HeadKind.EAGLE3 or _speculators_view(recorded) != _speculators_view(
        derived
    ):
        return derived
    return recorded


def _speculators_view(heads: HeadsConfig) -> tuple[object, ...]:
    return (layer_config(heads, None), heads.draft_rows, heads.target_layers)


def _verifier(data: dict[str, Any], layer: LlamaConfig, what: str) -> Verifier:
    described = (data.get("speculators_config") or {}).get("verifier") or {}
    if not isinstance(described, dict):
        raise InteropError(f"{what}: speculators_config.verifier must be an object")
    name = described.get("name_or_path")
    architectures = described.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise InteropError(f"{what}: verifier.architectures must be a list of names")
    return Verifier(
        name_or_path=name if isinstance(name, str) else None,
        architectures=tuple(architectures),
        max_position_embeddings=getattr(layer, "max_position_embeddings", None),
    )


def _speculative_tokens(data: dict[str, Any]) -> int | None:
    methods = (data.get("speculators_config") or {}).get("proposal_methods") or []
    first = methods[0] if isinstance(methods, list) and methods else {}
    tokens = first.get("speculative_tokens") if isinstance(first, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


def expected_shapes(heads: HeadsConfig) -> dict[str, tuple[int, ...]]:
    """The speculators tensors of EAGLE-3 ``heads`` and their shapes, embedding left out."""
    hidden, fused = heads.hidden_size, len(heads.target_layers)
    head_dim = hidden // heads.num_attention_heads
    queries, keys = heads.num_attention_heads * head_dim, heads.kv_heads * head_dim
    shapes = {
        "fc.weight": (hidden, fused * hidden),
        "norm.weight": (hidden,),
        "lm_head.weight": (heads.draft_rows, hidden),
    }
    layer = {
        "input_layernorm.weight": (hidden,),
        "hidden_norm.weight": (hidden,),
        "self_attn.q_proj.weight": (queries, 2 * hidden),
        "self_attn.k_proj.weight": (keys, 2 * hidden),
        "self_attn.v_proj.weight": (keys, 2 * hidden),
        "self_attn.o_proj.weight": (hidden, queries),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (heads.mlp_size, hidden),
        "mlp.up_proj.weight": (heads.mlp_size, hidden),
        "mlp.down_proj.weight": (hidden, heads.mlp_size),
    }
    shapes.update({LAYER + name: shape for name, shape in layer.items()})
    if heads.draft_vocab_size:
        shapes.update({"d2t": (heads.draft_rows,), "t2d": (heads.vocab_size,)})
    return shapes


def import_tensors(
    heads: HeadsConfig,
    tensors: dict[str, torch.Tensor],
    what: str,
    embedding: torch.Tensor,  # [vocab, H] the base's token embedding
) -> dict[str, torch.Tensor]:
    """speculators (or SpecForge: ``midlayer.``) tensors -> selfspec EAGLE-3 state, float32.

    A copy of the embedding must equal the base's; draft rows out of ascending order are put
    in order (lm_head rows and ``d2t`` together: the same drafts)."""
    named: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        canonical = LAYER + name[len(SELFSPEC_LAYER) :] if name.startswith(SELFSPEC_LAYER) else name
        if canonical in named:
            raise InteropError(f"{what}: {canonical} is there twice (as layers.0. and midlayer.)")
        named[canonical] = tensor
    for name in TRAINING_ONLY:
        named.pop(name, None)
    own_embedding = named.pop(EMBEDDING, None)
    if own_embedding is not None:
        _check_embedding(own_embedding, embedding, what)
    expected = expected_shapes(heads)
    if not heads.draft_vocab_size:  # whole vocabulary: maps optional, and then the identity
        _check_identity_maps(named.pop("d2t", None), named.pop("t2d", None), heads, what)
    found = {name: tuple(t.shape) for name, t in named.items()}
    if found != expected:
        missing = sorted(set(expected) - set(found))
        unexpected = sorted(set(found) - set(expected))
        wrong = sorted(
            f"{n} {found[n]} (expected {expected[n]})"
            for n in set(expected) & set(found)
            if expected[n] != found[n]
        )
        raise InteropError(
            f"{what}: the weights do not match config.json: missing {missing}, unexpected "
            f"{unexpected}, wrong shape {wrong}"
        )
    state: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        if name in ("d2t", "t2d"):
            continue
        if not tensor.dtype.is_floating_point:
            raise InteropError(f"{what}: {name} must be floating point, got {tensor.dtype}")
        ours = SELFSPEC_LAYER + name[len(LAYER) :] if name.startswith(LAYER) else name
        state[ours] = tensor.to(torch.float32).contiguous()
    if heads.draft_vocab_size:
        _import_maps(named["d2t"], named["t2d"], heads, state, what)
    else:
        state["d2t"] = torch.zeros(heads.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(heads.vocab_size, dtype=torch.bool)
    return state


def _check_embedding(own: torch.Tensor, embedding: torch.Tensor, what: str) -> None:
    if tuple(own.shape) != tuple(embedding.shape):
        raise InteropError(
            f"{what}: embed_tokens.weight is {tuple(own.shape)}, the base's embedding "
            f"{tuple(embedding.shape)}"
        )
    base = embedding.detach().to("cpu", own.dtype)  # compared in the checkpoint's precision
    if not torch.equal(own, base):
        gap = float((own.float() - base.float()).abs().max())
        raise InteropError(
            f"{what}: its embed_tokens.weight differs from the base's token embedding (max |diff| "
            f"{gap:.3g}); selfspec's EAGLE-3 heads read the target's own embedding, so these "
            "drafts cannot be reproduced: is --base the model the drafter was trained for?"
        )


def _check_identity_maps(
    d2t: torch.Tensor | None, t2d: torch.Tensor | None, heads: HeadsConfig, what: str
) -> None:
    if d2t is not None and (tuple(d2t.shape) != (heads.vocab_size,) or bool(d2t.any())):
        raise InteropError(f"{what}: draft_vocab_size is the whole vocabulary but d2t is not 0")
    if t2d is not None and (tuple(t2d.shape) != (heads.vocab_size,) or not bool(t2d.all())):
        raise InteropError(f"{what}: draft_vocab_size is the whole vocabulary but t2d is not 1")


def _import_maps(
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    heads: HeadsConfig,
    state: dict[str, torch.Tensor],
    what: str,
) -> None:
    """Draft index i drafts token i + d2t[i]; selfspec keeps the rows in ascending token order."""
    if d2t.dtype.is_floating_point or t2d.dtype.is_floating_point:
        raise InteropError(f"{what}: d2t and t2d must be integer / bool tensors")
    ids = torch.arange(heads.draft_rows) + d2t.long()  # [N] token id of each draft row
    try:
        ordered = check_draft_vocab(ids, heads.vocab_size, heads.draft_rows)
    except ValueError as error:
        raise InteropError(f"{what}: d2t: {error}") from error
    if not torch.equal(t2d.bool().nonzero().flatten(), ordered):
        raise InteropError(f"{what}: t2d does not mark exactly the token ids d2t maps to")
    order = ids.argsort()
    state["lm_head.weight"] = state["lm_head.weight"][order].contiguous()  # [N, H]
    state["d2t"] = ordered - torch.arange(heads.draft_rows)
    state["t2d"] = t2d.bool().contiguous()

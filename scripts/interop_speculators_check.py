"""Conformance of selfspec's speculators format with the real ``speculators`` library.

Run by ``scripts/interop_speculators.sh`` inside ``.venv-interop`` (speculators installed without
its pinned dependencies, torch and transformers shared with ``.venv``). On a tiny random Llama
target (4 layers, so EAGLE-3's default fused layers are distinct):

1. export: selfspec EAGLE-3 heads (whole vocabulary; a draft vocabulary; a draft vocabulary
   without the token embedding) are exported; speculators validates the config (its pydantic
   ``Eagle3SpeculatorConfig``), loads the weights with ``SpeculatorModel.from_pretrained``, and
   its ``Eagle3DraftModel.forward`` (eager attention, 3 training-time-test steps) must give the
   logits selfspec's head gives for the same target hidden states and tokens: step 0 against
   ``Eagle3Drafter``'s root draft at every prefix length, steps 1-2 against the head run under
   the same attention pattern;
2. import: a checkpoint written by speculators itself (``Eagle3DraftModel.save_pretrained``,
   random weights, a draft vocabulary) is imported and must give speculators' logits.

Prints versions and the largest |logit difference| of each comparison, then one JSON line;
exits 1 when a difference exceeds the float32 tolerance.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tiny_models import make_tiny_tokenizer, tiny_config  # noqa: E402

from selfspec.drafting.eagle3 import Eagle3Drafter  # noqa: E402
from selfspec.fingerprint import fingerprint_of  # noqa: E402
from selfspec.heads import Eagle3Head, build_heads, heads_config_for, load_heads, save_heads  # noqa: E402
from selfspec.heads.eagle import EagleCache  # noqa: E402
from selfspec.heads.eagle3 import init_from_target, with_eagle3_draft_vocab  # noqa: E402
from selfspec.interop import export_speculators, import_speculators  # noqa: E402
from selfspec.target_forward import TargetForward  # noqa: E402

TOLERANCE = 1e-4  # float32; observed differences are ~1e-6
STEPS = 3  # training-time-test steps of the speculators forward
SEQ = 12  # tokens whose target states are drafted from
DRAFT_IDS = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53]


def build_base(directory: Path) -> PreTrainedModel:
    config = tiny_config("llama")
    config.num_hidden_layers = 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    make_tiny_tokenizer().save_pretrained(directory)
    return model


def selfspec_heads(base: PreTrainedModel, draft_ids: list[int] | None, seed: int) -> Eagle3Head:
    heads = build_heads(heads_config_for(base, "eagle3"))
    init_from_target(heads, base.get_output_embeddings(), base.get_decoder().norm)
    if draft_ids is not None:
        heads = with_eagle3_draft_vocab(heads, torch.tensor(draft_ids), base.lm_head)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in heads.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    return heads.eval()


def target_inputs(base: PreTrainedModel, layers: tuple[int, ...], seed: int):  # type: ignore[no-untyped-def]
    """Tokens x_0..x_S and the target's fused states: # [1, S+1] and [1, S+1, k*H]."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, base.config.vocab_size, (1, SEQ + 1), generator=generator)
    with torch.no_grad():
        states = base(tokens, output_hidden_states=True).hidden_states
    return tokens, torch.cat([states[k] for k in layers], dim=-1)


def speculators_logits(model, tokens, aux):  # type: ignore[no-untyped-def]
    """speculators' forward on pairs (g_t, x_{t+1}) at positions t+1 (its shift_batch
    convention): the lm_head output of each step. # STEPS x [1, S, N]"""
    caught: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: caught.append(out.detach()))
    try:
        with torch.no_grad():
            model(
                hidden_states=aux[:, :-1],
                input_ids=tokens[:, 1:],
                document_ids=torch.zeros(1, SEQ, dtype=torch.long),
                position_ids=torch.arange(1, SEQ + 1)[None],
                ttt_steps=STEPS,
            )
    finally:
        hook.remove()
    return caught


def selfspec_ttt_logits(heads: Eagle3Head, embed, tokens, aux):  # type: ignore[no-untyped-def]
    """selfspec's head under speculators' training-time-test pattern: step k feeds the head its
    own step k-1 output with the tokens shifted by k (0 past the end); position t attends to
    steps-0 positions <= t and to itself at every later step. # STEPS x [1, S, N]"""
    cache, out = EagleCache(), []
    features = heads.fuse(aux[:, :-1])  # [1, S, H]
    inputs = tokens[:, 1:]
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    with torch.no_grad():
        for step in range(STEPS):
            attend = torch.cat([causal] + [torch.eye(SEQ, dtype=torch.bool)] * step, dim=-1)
            positions = torch.arange(1, SEQ + 1)[None] + step
            hidden = heads(embed(inputs), features, positions, attend[None, None], cache)
            out.append(heads.logits(hidden))
            features = hidden
            inputs = torch.cat([tokens[:, 2 + step :], tokens.new_zeros(1, 1 + step)], dim=-1)
    return out


def drafter_root_logits(heads: Eagle3Head, base: PreTrainedModel, tokens, aux):  # type: ignore[no-untyped-def]
    """selfspec's EAGLE-3 drafter: the root draft distribution after a prompt of each length
    p (x_0..x_{p-1} committed, x_p the first new token). # [1, S, N]"""
    drafter = Eagle3Drafter(heads, TargetForward(base, lean=False))
    rows = []
    with torch.no_grad():
        for p in range(1, SEQ + 1):
            state = drafter.start(aux[0, :p], tokens[0, :p], int(tokens[0, p]))
            rows.append(drafter.projection.logits(state.root_feature))
    return torch.stack(rows)[None]


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def compare(reference, mine, root) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Largest |difference| per step and for the drafter's root drafts, and the logits' scale."""
    result = {f"step{k}": gap(reference[k], mine[k]) for k in range(STEPS)}
    result["drafter_root"] = gap(reference[0], root)
    result["max_abs_logit"] = max(float(r.abs().max()) for r in reference)
    return result


def load_speculators(path: Path, embedding_in_checkpoint: bool = True):  # type: ignore[no-untyped-def]
    from speculators import SpeculatorModel, SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = SpeculatorModelConfig.from_pretrained(str(path))  # pydantic validation
    assert type(config) is Eagle3SpeculatorConfig, type(config)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention wants a GPU
    model = SpeculatorModel.from_pretrained(str(path), config=config)
    assert type(model) is Eagle3DraftModel, type(model)
    if embedding_in_checkpoint:
        assert not any(p.isnan().any() for p in model.parameters()), "weights left unloaded"
    return model.eval()


def check_export(  # type: ignore[no-untyped-def]
    base, base_dir: Path, work: Path, draft_ids, name: str, embedding: bool
) -> dict[str, float]:
    heads = selfspec_heads(base, draft_ids, seed=1)
    heads_dir = save_heads(heads, work / f"{name}-heads", fingerprint_of(base))
    out = export_speculators(
        heads_dir, work / f"{name}-speculators", base, str(base_dir), embedding=embedding
    )
    model = load_speculators(out, embedding_in_checkpoint=embedding)
    if not embedding:
        # speculators 0.9.0 leaves an embedding missing from the checkpoint uninitialised under
        # transformers 5.x (its "NaN = not loaded" sentinel does not survive from_pretrained),
        # so it is installed here from the verifier, as vLLM shares the target's.
        with torch.no_grad():
            model.embed_tokens.weight.copy_(base.get_input_embeddings().weight)
    assert model.config.eagle_aux_hidden_state_layer_ids == list(heads.config.target_layers)
    assert torch.equal(model.embed_tokens.weight, base.get_input_embeddings().weight)
    ours = {k.replace("midlayer.", "layers.0."): v for k, v in heads.state_dict().items()}
    theirs = model.state_dict()
    for key, value in ours.items():
        if key in ("d2t", "t2d") and draft_ids is None:
            assert getattr(model, key) is None  # speculators keeps no maps for the whole vocab
            continue
        assert torch.equal(theirs[key], value), key
    tokens, aux = target_inputs(base, heads.config.target_layers, seed=2)
    reference = speculators_logits(model, tokens, aux)
    mine = selfspec_ttt_logits(heads, base.get_input_embeddings(), tokens, aux)
    return compare(reference, mine, drafter_root_logits(heads, base, tokens, aux))


def speculators_fixture(base_dir: Path, out: Path) -> torch.nn.Module:
    """A checkpoint written by speculators itself: random weights, a draft vocabulary."""
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = LlamaConfig(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=len(DRAFT_IDS),
        norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=[0, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(str(base_dir)),
        ),
    )
    model = Eagle3DraftModel(config)
    ids = torch.tensor(DRAFT_IDS)
    t2d = torch.zeros(101, dtype=torch.bool)
    t2d[ids] = True
    model.load_vocab_mappings(t2d, ids - torch.arange(len(ids)))
    model.load_verifier_weights()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.startswith(("embed_tokens", "verifier_")):
                param.copy_(
                    torch.randn(param.shape, generator=generator) * 0.2 + param.nan_to_num()
                )
    model.save_pretrained(str(out))
    return model.eval()


def check_import(base, base_dir: Path, work: Path) -> dict[str, float]:  # type: ignore[no-untyped-def]
    fixture = work / "written-by-speculators"
    speculators_fixture(base_dir, fixture)
    model = load_speculators(fixture)  # as speculators reads its own checkpoint back
    out = import_speculators(fixture, work / "imported-heads", base, str(base_dir))
    heads = load_heads(out, target=base)
    assert heads.config.target_layers == (0, 2, 3) and heads.config.draft_vocab_size == 16
    assert (torch.arange(16) + heads.d2t).tolist() == DRAFT_IDS
    tokens, aux = target_inputs(base, heads.config.target_layers, seed=4)
    reference = speculators_logits(model, tokens, aux)
    mine = selfspec_ttt_logits(heads, base.get_input_embeddings(), tokens, aux)
    return compare(reference, mine, drafter_root_logits(heads, base, tokens, aux))


def check_trained(heads_dir: Path, base_dir: Path, work: Path) -> dict[str, float]:
    """Trained EAGLE-3 heads for the base at ``base_dir`` (an HF directory), exported, read by
    speculators, compared on the base's own hidden states."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    heads = load_heads(heads_dir, target=base)
    out = export_speculators(heads_dir, work / "trained-speculators", base, str(base_dir))
    model = load_speculators(out)
    tokens, aux = target_inputs(base, heads.config.target_layers, seed=5)
    reference = speculators_logits(model, tokens, aux)
    mine = selfspec_ttt_logits(heads, base.get_input_embeddings(), tokens, aux)
    return compare(reference, mine, drafter_root_logits(heads, base, tokens, aux))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--trained-heads", type=Path, help="also check these EAGLE-3 heads ...")
    parser.add_argument("--trained-base", type=Path, help="... on this base (HF directory)")
    args = parser.parse_args()
    if (args.trained_heads is None) != (args.trained_base is None):
        parser.error("--trained-heads and --trained-base go together")
    torch.manual_seed(0)
    versions = {
        name: version(name) for name in ("speculators", "torch", "transformers", "pydantic")
    }
    versions["python"] = platform.python_version()
    print("versions:", ", ".join(f"{k} {v}" for k, v in versions.items()))
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = build_base(work / "base")
        results["export_whole_vocab"] = check_export(
            base, work / "base", work, None, "whole", embedding=True
        )
        results["export_draft_vocab"] = check_export(
            base, work / "base", work, DRAFT_IDS, "draft", embedding=True
        )
        results["export_draft_vocab_no_embedding"] = check_export(
            base, work / "base", work, DRAFT_IDS, "bare", embedding=False
        )
        results["import_from_speculators"] = check_import(base, work / "base", work)
        if args.trained_heads is not None:
            results["trained_heads"] = check_trained(args.trained_heads, args.trained_base, work)
    worst = max(v for r in results.values() for k, v in r.items() if k != "max_abs_logit")
    for name, result in results.items():
        diffs = ", ".join(f"{k} {v:.2e}" for k, v in result.items() if k != "max_abs_logit")
        print(f"{name}: max |logit diff| {diffs} (logits up to {result['max_abs_logit']:.2f})")
    ok = worst <= TOLERANCE
    print(f"{'PASS' if ok else 'FAIL'}: worst {worst:.2e} (tolerance {TOLERANCE:.0e})")
    summary = {"versions": versions, "results": results, "worst": worst, "ok": ok}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""`selfspec generate --adapter`: the adapter's own output, speculating or not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lora_helpers import reference_under
from tiny_models import make_tiny_tokenizer, save_tiny_target

from selfspec import build_heads, heads_config_for, save_heads
from selfspec.cli import main
from selfspec.fingerprint import fingerprint_of

PROMPT = "hello adapters"
NEW = 12


@pytest.fixture(scope="module")
def target_and_heads(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cli")
    target = save_tiny_target(root / "tiny-llama")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target)
    heads = save_heads(
        build_heads(heads_config_for(model, "medusa")), root / "heads", fingerprint_of(model)
    )
    return target, heads


def _generate(capsys, *argv: str) -> tuple[int, dict | str]:
    code = main(["generate", "--no-chat", "--json", "--max-new-tokens", str(NEW), *argv])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else captured.err


def test_generate_with_adapter_dir_and_by_name(capsys, target_and_heads, adapter_root) -> None:
    target, heads = target_and_heads
    prompt_ids = make_tiny_tokenizer().encode(PROMPT)
    expected = reference_under(adapter_root / "all.linear", prompt_ids, NEW)
    common = ["--prompt", PROMPT, "--model", str(target)]
    code, by_dir = _generate(
        capsys, *common, "--heads", str(heads), "--adapter", str(adapter_root / "all.linear")
    )
    assert code == 0 and by_dir["token_ids"] == expected
    code, by_name = _generate(
        capsys, *common, "--no-speculation", "--adapter", "all.linear",
        "--adapters-root", str(adapter_root),
    )
    assert code == 0 and by_name["token_ids"] == expected
    code, base = _generate(capsys, *common, "--heads", str(heads))
    assert code == 0 and base["token_ids"] != expected


def test_generate_with_unknown_adapter_is_a_clear_error(capsys, target_and_heads, adapter_root):
    target, _ = target_and_heads
    code, err = _generate(
        capsys, "--prompt", PROMPT, "--model", str(target), "--no-speculation",
        "--adapter", "nope", "--adapters-root", str(adapter_root),
    )
    assert code == 2
    assert "unknown adapter 'nope'" in err and "all.linear, attn, mlp_down" in err


def test_generate_uses_the_adapters_own_heads(capsys, target_and_heads, adapter_root, tmp_path):
    import shutil

    target, heads = target_and_heads
    shutil.copytree(adapter_root / "attn", tmp_path / "attn")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target)
    own = build_heads(heads_config_for(model, "eagle"))
    save_heads(own, tmp_path / "attn" / "heads", fingerprint_of(model))
    common = ["--prompt", PROMPT, "--model", str(target), "--heads", str(heads)]
    common += ["--tree", "chain:2"]
    runs = {}
    for flag in ("--adapter-heads", "--no-adapter-heads"):
        code = main(["generate", "--no-chat", "--json", "--max-new-tokens", str(NEW), *common,
                     "--adapter", str(tmp_path / "attn"), flag])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        runs[flag] = (json.loads(captured.out)["token_ids"], captured.err)
    assert "speculating with attn's own heads" in runs["--adapter-heads"][1]
    assert "own heads" not in runs["--no-adapter-heads"][1]
    expected = reference_under(adapter_root / "attn", make_tiny_tokenizer().encode(PROMPT), NEW)
    assert runs["--adapter-heads"][0] == runs["--no-adapter-heads"][0] == expected


@pytest.mark.parametrize(
    ("config_text", "says"),
    [
        ('{"peft_type": "LORA", "target_modules": "(.*)(.*)(.*)(.*)(.*)(.*)X"}', "backtracking"),
        ("[" * 200_000 + "]" * 200_000, "nested too deeply"),
        ('{"r": ' + "9" * 5000 + "}", "Exceeds the limit"),
    ],
)
def test_generate_with_a_bad_adapter_is_a_clear_error(
    capsys, target_and_heads, adapter_root, tmp_path, config_text, says
) -> None:
    import shutil

    target, _ = target_and_heads
    bad = shutil.copytree(adapter_root / "attn", tmp_path / "root" / "bad")
    (bad / "adapter_config.json").write_text(config_text)
    common = ["--prompt", PROMPT, "--model", str(target), "--no-speculation"]
    by_dir = _generate(capsys, *common, "--adapter", str(bad))
    by_name = _generate(capsys, *common, "--adapter", "bad", "--adapters-root", str(bad.parent))
    for code, err in (by_dir, by_name):
        assert code == 2
        assert "selfspec generate: error: adapter 'bad'" in err and says in err, err
        assert "Traceback" not in err


def test_generate_asks_the_speculation_gate_unless_told_not_to(
    capsys, target_and_heads, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adaptive request's steps draft only when the gate says so (here: never, every step
    plain without context drafts, the output unchanged); --no-speculation-gate never asks it."""
    from selfspec.speculation_gate import SpeculationGate

    target, heads = target_and_heads
    asked: list[int] = []
    monkeypatch.setattr(SpeculationGate, "choose", lambda self, batch: asked.append(batch) or False)
    common = ["--prompt", PROMPT, "--model", str(target), "--heads", str(heads)]
    common += ["--no-context-drafts"]
    code, gated = _generate(capsys, *common)
    assert code == 0 and asked and gated["stats"]["mean_tree_size"] == 1.0
    asked.clear()
    code, ungated = _generate(capsys, *common, "--no-speculation-gate")
    assert code == 0 and not asked and ungated["token_ids"] == gated["token_ids"]


def test_generate_drafts_from_context_unless_told_not_to(
    capsys, target_and_heads, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Context drafts are on by default (a request indexes its tokens); --no-context-drafts
    leaves them out; the output is the same either way."""
    import selfspec.generation as generation

    indexed: list[int] = []

    class CountingIndex(generation.ContextIndex):
        def __init__(self, options, tokens, corpus=None) -> None:
            indexed.append(len(tokens))
            super().__init__(options, tokens, corpus)

    monkeypatch.setattr(generation, "ContextIndex", CountingIndex)
    target, heads = target_and_heads
    common = ["--prompt", PROMPT, "--model", str(target), "--heads", str(heads)]
    common += ["--tree", "dynamic:2,3,6"]
    code, with_context = _generate(capsys, *common)
    assert code == 0 and indexed == [len(make_tiny_tokenizer().encode(PROMPT)) + 1]
    indexed.clear()
    code, heads_only = _generate(capsys, *common, "--no-context-drafts")
    assert code == 0 and not indexed
    assert heads_only["token_ids"] == with_context["token_ids"]

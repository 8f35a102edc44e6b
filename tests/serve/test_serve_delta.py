"""Draft deltas in the server: an adapter carrying `heads-delta/` drafts with the shared heads
plus its delta (loaded on its first request, dropped on unload), output still equal to vanilla;
a delta for other heads is a 400 naming the adapter, and the server keeps serving."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import httpx
import torch

from selfspec.heads import load_heads
from selfspec.heads.delta import (
    DELTA_DIR,
    Delta,
    DeltaConfig,
    delta_state,
    heads_hash,
    save_delta,
    with_trainable_delta,
)
from selfspec.target import TargetSpec, load_target

BODY = {"prompt": "hello world", "temperature": 0, "max_tokens": 24, "ignore_eos": True}


def _delta_for(heads_dir: Path, target_dir: Path, destination: Path, tamper: bool = False) -> None:
    model = load_target(TargetSpec(model=str(target_dir))).model
    shared = load_heads(heads_dir, model)
    trainable = with_trainable_delta(copy.deepcopy(shared), DeltaConfig(rank=4, alpha=8))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        for name, param in trainable.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0, 0.3)
    recorded = "0" * 16 if tamper else heads_hash(shared)
    save_delta(Delta(DeltaConfig(rank=4, alpha=8), recorded, delta_state(trainable)), destination)


def test_an_adapters_delta_drafts_for_it_losslessly_and_goes_on_unload(
    server_for, assets, tmp_path: Path
) -> None:
    root = tmp_path / "adapters"
    shutil.copytree(assets["adapters"], root)
    _delta_for(assets["heads"], assets["target"], root / "attn" / DELTA_DIR)
    _delta_for(assets["heads"], assets["target"], root / "mlp" / DELTA_DIR, tamper=True)
    with server_for(adapters_root=str(root), enable_lora_management=True) as (url, state, _):
        spec = httpx.post(f"{url}/v1/completions", json={**BODY, "model": "attn"}).json()
        plain = httpx.post(
            f"{url}/v1/completions", json={**BODY, "model": "attn", "speculation": False}
        ).json()
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
        assert spec["selfspec"]["speculation"] and "attn" in state.delta_bank
        bad = httpx.post(f"{url}/v1/completions", json={**BODY, "model": "mlp"})
        assert bad.status_code == 400
        assert "'mlp'" in bad.json()["error"]["message"] and "other heads" in bad.text
        base = httpx.post(f"{url}/v1/completions", json={**BODY, "model": "tiny-llama"})
        assert base.status_code == 200
        unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "attn"})
        assert unload.status_code == 200
        assert "attn" not in state.delta_bank and state.delta_bank.nbytes == 0

"""A decoder layer's parts as one C++ call each (``selfspec.fused_layer``): the same bits as the
lean body's module-by-module kernel path, in every mode with fp32 activations and in bfloat16
(transformers' norm and the lean body's rotary as the same ATen ops), on every architecture the
lean body runs; a part with a hook, a replaced module or a changed weight is
run or re-planned so that nothing changes."""

from __future__ import annotations

import pytest
import torch
from conftest import cpp_paths
from tiny_models import install_block_kernels, make_tiny_model
from transformers import DynamicCache

from selfspec.adapters.fast_lora import LoraBank, LoraWeights
from selfspec.drafting.taps import LayerTaps
from selfspec.fused_layer import FusedLayer, FusedParts, unfusable_reason
from selfspec.growing_cache import growing_cache
from selfspec.kernels import extension
from selfspec.kernels.modules import install_kernels
from selfspec.lean_body import LeanBody, _fused_norm

pytestmark = pytest.mark.skipif(not cpp_paths(), reason="the C++ kernels are not built here")

ARCHS = ("llama", "qwen2", "mistral")  # qwen2: q/k/v with bias


def _model(arch: str, mode: str = "float32"):
    model = make_tiny_model(arch).eval()
    if mode == "float32:int24":  # float32 from quantized blocks, 24-bit integer activations
        install_block_kernels(model, "int24")
    elif mode == "bfloat16":
        install_kernels(model.to(torch.bfloat16), mode)
    else:
        install_kernels(model, mode)
    return model


def _tree_mask(cached: int, parents: list[int]) -> torch.Tensor:
    """Additive mask [1, 1, S, cached + S] of a tree (``parents[i]`` < i, -1 for the root)."""
    size = len(parents)
    allowed = torch.zeros(size, cached + size, dtype=torch.bool)
    allowed[:, :cached] = True
    for node, parent in enumerate(parents):
        allowed[node, cached + node] = True
        if parent >= 0:
            allowed[node] |= allowed[parent]
    return torch.where(allowed, 0.0, -torch.inf)[None, None]


def _run(body: LeanBody, fused: bool, growing: bool = False) -> list[torch.Tensor]:
    """Prefill 7 tokens (B = 2, causal), then a 5-node tree step over the cache with a mask.
    Returns the hidden states of both calls and the cache's keys and values. ``growing``: a
    cache that grows in place, with which a fully fused body runs as one call."""
    saved, saved_body = body.fused_layers, body.fused_body
    if not fused:
        body.fused_layers, body.fused_body = [None] * len(saved), None
    try:
        generator = torch.Generator().manual_seed(0)
        cache = growing_cache(body.config) if growing else DynamicCache()
        prompt = torch.randint(3, 101, (2, 7), generator=generator)
        positions = torch.arange(7).expand(2, 7)
        with torch.inference_mode():
            first = body(prompt, positions, cache)
            tree = torch.randint(3, 101, (2, 5), generator=generator)
            depths = torch.tensor([0, 1, 1, 2, 2])
            mask = _tree_mask(7, [-1, 0, 0, 1, 2]).expand(2, 1, 5, 12).contiguous()
            second = body(tree, (7 + depths).expand(2, 5), cache, mask)
        states = [first, second]
        for layer in cache.layers:
            states += [layer.keys.clone(), layer.values.clone()]
        return states
    finally:
        body.fused_layers, body.fused_body = saved, saved_body


@pytest.mark.parametrize("mode", ["float32", "bfloat16", "int8", "int4", "w4a8", "float32:int24"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("isa", cpp_paths())
def test_fused_layers_give_the_module_path_bits(
    arch: str, mode: str, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(extension.ISA_ENV, isa)
    body = LeanBody(_model(arch, mode).model)
    assert all(layer is not None for layer in body.fused_layers)
    dtype = torch.bfloat16 if mode == "bfloat16" else torch.float32
    hidden = torch.zeros(1, 1, body.config.hidden_size, dtype=dtype)
    assert body.fused_layers[0].parts(hidden) == FusedParts(True, True, True)
    other = torch.float32 if mode == "bfloat16" else torch.bfloat16  # not the layers' dtype
    assert body.fused_layers[0].parts(hidden.to(other)) == FusedParts()
    fused, modules = _run(body, fused=True), _run(body, fused=False)
    for a, b in zip(fused, modules, strict=True):
        assert torch.equal(a, b)
    whole_calls = _count_calls(monkeypatch, body, "_whole_body")
    whole = _run(body, fused=True, growing=True)
    assert whole_calls == [1, 1]  # the prefill and the tree step, each one call
    for a, b in zip(whole, modules, strict=True):
        assert torch.equal(a, b)


def _count_calls(monkeypatch: pytest.MonkeyPatch, obj: object, name: str) -> list[int]:
    """Wrap ``obj.name`` to record each call (as a 1); returns the growing record."""
    calls: list[int] = []
    original = getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls


def test_the_whole_body_runs_as_one_call_only_when_every_part_may() -> None:
    """A hooked part anywhere sends the forward layer by layer; the bits stay the same."""
    body = LeanBody(_model("llama").model)
    expected = _run(body, fused=False, growing=True)
    layer = body.layers[1]
    handle = layer.mlp.up_proj.register_forward_hook(lambda _m, _a, out: None)
    try:
        assert body._whole_body_plan(torch.zeros(1, 1, 32), [growing_cache(body.config)]) is None
        hooked = _run(body, fused=True, growing=True)
    finally:
        handle.remove()
    whole = body._whole_body_plan(torch.zeros(1, 1, 32), [growing_cache(body.config)])
    assert whole.readers == {} and whole.delta_hooks is None
    plan = whole.plan
    assert body._whole_body_plan(torch.zeros(1, 1, 32), [DynamicCache()]) is None
    for a, b in zip(hooked, expected, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():  # a changed weight: a new plan for its layer, so for the body
        layer.mlp.down_proj.weight.mul_(2.0)
    assert (
        body._whole_body_plan(torch.zeros(1, 1, 32), [growing_cache(body.config)]).plan is not plan
    )
    changed, modules = _run(body, fused=True, growing=True), _run(body, fused=False, growing=True)
    for a, b in zip(changed, modules, strict=True):
        assert torch.equal(a, b)


def test_layer_taps_read_the_same_streams_from_the_whole_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EAGLE-3's taps (reader hooks on input norms) keep the body one call; what they record
    equals what the module path shows them, as do the outputs; any other hook stops it."""
    body = LeanBody(_model("llama").model)
    count = len(body.layers)
    taps = LayerTaps(body.body, (0, 1, count))

    def tapped(fused: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        with taps.capture() as record:
            outputs = _run(body, fused=fused, growing=True)
        return outputs, [record.states[k] for k in (0, 1, count)]

    whole_calls = _count_calls(monkeypatch, body, "_whole_body")
    (outputs, states), (expected_outputs, expected_states) = tapped(True), tapped(False)
    assert whole_calls == [1, 1]
    for i, (a, b) in enumerate(
        zip(outputs + states, expected_outputs + expected_states, strict=True)
    ):
        assert torch.equal(a, b), i
    assert states[2].shape[1] == 5  # the last forward (the tree step) wins
    other = body.layers[1].input_layernorm.register_forward_pre_hook(lambda _m, args: None)
    try:
        with taps.capture():
            assert (
                body._whole_body_plan(torch.zeros(1, 1, 32), [growing_cache(body.config)]) is None
            )
    finally:
        other.remove()


def _bank(model, names: tuple[str, ...]) -> LoraBank:
    """A LoRA bank on ``model`` with one random rank-4 adapter per name on every linear layer
    of its body (not the lm_head)."""
    bank = LoraBank(model)
    generator = torch.Generator().manual_seed(3)
    for name in names:
        weights = {}
        for module_name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in module_name:
                a = torch.randn(4, module.in_features, generator=generator) * 0.1
                b = torch.randn(module.out_features, 4, generator=generator) * 0.1
                weights[module_name] = LoraWeights(a, b, 2.0)
        bank.add(name, weights)
    return bank


@pytest.mark.parametrize("mode", ["float32", "int4", "bfloat16"])
@pytest.mark.parametrize("selection", ["one", "base", "rows"])
def test_lora_bank_deltas_run_in_the_whole_body(
    mode: str, selection: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The LoRA bank's hooks (one adapter, the base, or one adapter per row) keep the body one
    C++ call, which adds their deltas with the same bits as the hooks."""
    model = _model("llama", mode)
    bank = _bank(model, ("a", "b"))
    body = LeanBody(model.model)
    if selection == "one":
        bank.select("a")
    elif selection == "base":
        bank.select(None)
    else:
        bank.select_rows(["b", None])  # the batch of 2 rows: adapter b, the base
    whole_calls = _count_calls(monkeypatch, body, "_whole_body")
    whole = _run(body, fused=True, growing=True)
    assert whole_calls == [1, 1]
    modules = _run(body, fused=False, growing=True)
    bank.select(None)
    bare = _run(body, fused=True, growing=True)
    for a, b in zip(whole, modules, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(whole[0], bare[0]) == (selection == "base")
    if selection == "rows":  # row 1 runs the base: its hidden states are the bare model's
        assert torch.equal(whole[1][1], bare[1][1]) and not torch.equal(whole[1][0], bare[1][0])


def test_a_rows_delta_for_another_batch_is_refused() -> None:
    model = _model("llama")
    bank = _bank(model, ("a", "b"))
    body = LeanBody(model.model)
    bank.select_rows(["a", "b", None])  # 3 rows selected; the forward has 2
    with pytest.raises(ValueError, match="mixed-adapter batch of 3 rows"):
        _run(body, fused=True, growing=True)


def _ragged_inputs(body: LeanBody, sizes: tuple[int, ...], prompt_lengths: tuple[int, ...]):
    """Requests with their own growing caches, each prefilled alone (prompts of
    ``prompt_lengths``), and a chain-and-fork tree of ``sizes[g]`` nodes for each: (caches,
    trees [S_g], positions [S_g], masks [1, S_g, P_g + S_g])."""
    generator = torch.Generator().manual_seed(1)
    caches, trees, positions, masks = [], [], [], []
    for size, length in zip(sizes, prompt_lengths, strict=True):
        cache = growing_cache(body.config)
        with torch.inference_mode():
            body(
                torch.randint(3, 101, (1, length), generator=generator),
                torch.arange(length)[None],
                cache,
            )
        parents = [-1] + [max(0, node - 2) for node in range(1, size)]
        depths = [0] * size
        for node in range(1, size):
            depths[node] = depths[parents[node]] + 1
        caches.append(cache)
        trees.append(torch.randint(3, 101, (size,), generator=generator))
        positions.append(length + torch.tensor(depths))
        masks.append(_tree_mask(length, parents)[0])
    return caches, trees, positions, masks


def _rows_forward(body: LeanBody, caches, trees, positions, masks, dtype) -> torch.Tensor | None:
    """``body.rows_forward`` of the trees back to back, each over its own cache # [1, N, H]."""
    with torch.inference_mode():
        return body.rows_forward(
            torch.cat(trees)[None],
            torch.cat(positions)[None],
            caches,
            [int(tree.shape[0]) for tree in trees],
            [mask.to(dtype) for mask in masks],
        )


@pytest.mark.parametrize("mode", ["float32", "bfloat16", "int4", "float32:int24"])
@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_rows_give_each_requests_own_bits(arch: str, mode: str) -> None:
    """Trees of different sizes back to back in one whole-body call (no padding), each over its
    own cache: every request's states and cache entries are those of its forward of its own."""
    model = _model(arch, mode)
    body = LeanBody(model.model)
    sizes, prompts = (3, 6, 1), (7, 4, 9)
    caches, trees, positions, masks = _ragged_inputs(body, sizes, prompts)
    dtype = next(model.parameters()).dtype
    ragged = _rows_forward(body, caches, trees, positions, masks, dtype)
    assert ragged is not None and ragged.shape[:2] == (1, sum(sizes))
    alone_caches, _, _, _ = _ragged_inputs(body, sizes, prompts)
    offset = 0
    for g, size in enumerate(sizes):
        with torch.inference_mode():
            alone = body(
                trees[g][None], positions[g][None], alone_caches[g], masks[g][None].to(dtype)
            )
        assert torch.equal(ragged[0, offset : offset + size], alone[0])
        for got, want in zip(caches[g].layers, alone_caches[g].layers, strict=True):
            assert got.get_seq_length() == prompts[g] + size
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        offset += size


@pytest.mark.parametrize("mode", ["float32", "int4", "bfloat16"])
def test_ragged_rows_on_different_adapters_give_each_requests_own_bits(mode: str) -> None:
    """A mixed-adapter batch back to back: each request's tokens get its own adapter's delta
    (one row of the per-row delta per request), its states and cache entries those of its
    forward of its own under that adapter, bit for bit."""
    model = _model("llama", mode)
    bank = _bank(model, ("a", "b"))
    body = LeanBody(model.model)
    adapters, sizes, prompts = ["a", None, "b"], (2, 4, 3), (5, 6, 4)
    dtype = next(model.parameters()).dtype

    def prefilled():  # each request's prompt under its own adapter
        built = []
        for g, name in enumerate(adapters):
            bank.select(name)
            built.append([part[g] for part in _ragged_inputs(body, sizes, prompts)])
        return [list(part) for part in zip(*built, strict=True)]

    caches, trees, positions, masks = prefilled()
    bank.select_rows(adapters)
    ragged = _rows_forward(body, caches, trees, positions, masks, dtype)
    assert ragged is not None
    alone_caches, _, _, _ = prefilled()
    offset = 0
    for g, (name, size) in enumerate(zip(adapters, sizes, strict=True)):
        bank.select(name)
        with torch.inference_mode():
            alone = body(
                trees[g][None], positions[g][None], alone_caches[g], masks[g][None].to(dtype)
            )
        assert torch.equal(ragged[0, offset : offset + size], alone[0]), name
        for got, want in zip(caches[g].layers, alone_caches[g].layers, strict=True):
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        offset += size
    bank.select_rows(["a", "b"])  # 2 rows selected; the forward has 3 segments
    with pytest.raises(ValueError, match="mixed-adapter batch of 2 rows"):
        _rows_forward(body, alone_caches, trees, positions, masks, dtype)


def test_ragged_lengths_that_do_not_cover_the_tokens_are_refused() -> None:
    model = _model("llama")
    body = LeanBody(model.model)
    caches, trees, positions, masks = _ragged_inputs(body, (2, 3), (4, 4))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="sum to 4, hidden has 5"):
        body.rows_forward(
            torch.cat(trees)[None],
            torch.cat(positions)[None],
            caches,
            [2, 2],
            masks,
        )
    assert [cache.get_seq_length() for cache in caches] == [4, 4]  # nothing counted


def test_each_part_equals_its_modules() -> None:
    model = _model("llama")
    layer = model.model.layers[0]
    fast = FusedLayer(layer)
    hidden = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(1))
    body = LeanBody(model.model)
    with torch.inference_mode():
        assert fast.parts(hidden).mlp
        got = fast.mlp_block(hidden, "auto")
        # The norm is the kernels' (the lean body's fp32 path), not transformers' module:
        expected = hidden + layer.mlp(_fused_norm(layer.post_attention_layernorm, hidden))
        assert torch.equal(got, expected)
        body_out = body(torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 2]]), DynamicCache())
    assert body_out.shape == (1, 3, 32)


def test_a_hooked_part_runs_its_modules_and_nothing_changes() -> None:
    body = LeanBody(_model("llama").model)
    expected = _run(body, fused=True)
    layer = body.layers[1]
    seen: list[torch.Size] = []
    handle = layer.mlp.up_proj.register_forward_hook(lambda _m, _a, out: seen.append(out.shape))
    try:
        assert body.fused_layers[1].parts(torch.zeros(1, 1, 32)) == FusedParts(True, True, False)
        got = _run(body, fused=True)
    finally:
        handle.remove()
    assert len(seen) == 2  # the prefill and the tree step called the hooked layer's MLP
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    tap = layer.input_layernorm.register_forward_pre_hook(lambda _m, args: None)
    try:
        assert body.fused_layers[1].parts(torch.zeros(1, 1, 32)) == FusedParts(False, True, True)
    finally:
        tap.remove()


def test_a_changed_weight_is_planned_again() -> None:
    body = LeanBody(_model("qwen2").model)
    _run(body, fused=True)  # plans made
    with torch.no_grad():
        body.layers[0].mlp.down_proj.weight.mul_(2.0)
        body.layers[1].self_attn.q_proj.bias.add_(0.5)
    fused, modules = _run(body, fused=True), _run(body, fused=False)
    for a, b in zip(fused, modules, strict=True):
        assert torch.equal(a, b)


def test_a_replaced_module_is_not_fused() -> None:
    body = LeanBody(_model("llama").model)
    layer = body.layers[0]
    original = layer.self_attn.v_proj
    layer.self_attn.v_proj = torch.nn.Linear(32, 16, bias=False)  # as peft's wrapper would
    try:
        assert body.fused_layers[0].parts(torch.zeros(1, 1, 32)) == FusedParts()
    finally:
        layer.self_attn.v_proj = original
    assert body.fused_layers[0].parts(torch.zeros(1, 1, 32)) == FusedParts(True, True, True)


def test_what_cannot_be_fused_says_why() -> None:
    plain = make_tiny_model("llama").eval()  # transformers' own linear layers
    assert "not a KernelLinear" in unfusable_reason(plain.model.layers[0])
    assert all(layer is None for layer in LeanBody(plain.model).fused_layers)
    with pytest.raises(ValueError, match="can't run fused"):
        FusedLayer(plain.model.layers[0])
    module = extension.load()
    norm = torch.ones(32)
    with pytest.raises(RuntimeError, match="7 linear layers"):
        module.DecoderLayerPlan(norm, 1e-5, norm, 1e-5, [], 4, 2, 8, 0.35)

// One Llama-style decoder layer as three calls instead of ~20 torch ops and module calls from
// Python (a 1-token step of a 30-layer model spends more time in that glue than in its linear
// layers). Each call computes exactly what the lean body's kernel path computes op by op: the
// same kernels (ops.cpp) and the same ATen element-wise ops (add, silu, mul), in the same order,
// so the bits are the same; the Python side (selfspec/fused_layer.py) calls a part only when
// none of its modules has a hook, an adapter or a changed weight. A float32 layer normalises and
// rotates with the kernels' own rms_norm and rotary_ (as the lean body's fp32 glue does); a
// bfloat16 layer with the very ATen ops of transformers' RMS norm and of the lean body's rotary
// (hf_rms_norm, rotate_half_bf16), so that it equals the module-by-module bf16 forward.
#include <torch/extension.h>

#include <string>
#include <utility>
#include <vector>

#include "ops.h"

namespace selfspec_kernels {

namespace {

// A decoder layer's weights, held once: the two RMS norms, seven linear layers, the head shape.
struct DecoderLayerPlan {
  torch::Tensor input_norm, post_norm;  // [H], the layer's dtype: fp32 or bf16
  double input_eps, post_eps;
  KernelMatrix q, k, v, o, gate, up, down;
  int64_t heads, kv_heads, head_dim;
  double scaling;
};

void check_norm(const torch::Tensor& weight, const char* name) {
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && weight.dim() == 1 &&
                  (weight.scalar_type() == torch::kFloat32 ||
                   weight.scalar_type() == torch::kBFloat16),
              name, " must be a contiguous float32 or bfloat16 [H] CPU tensor");
}

// The layer's activations' dtype: its norms'.
torch::ScalarType layer_dtype(const DecoderLayerPlan& p) { return p.post_norm.scalar_type(); }

// transformers' RMS norm on a bf16 stream, op for op (LlamaRMSNorm.forward: to float32,
// pow(2).mean(-1, keepdim), x * rsqrt(variance + eps), to bf16, weight * x): the same ATen
// kernels, so the same bits as the module. x [..., H] bf16 -> [..., H] bf16.
torch::Tensor hf_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const torch::Tensor wide = x.to(torch::kFloat32);
  const torch::Tensor variance = wide.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (wide * at::rsqrt(variance + eps)).to(x.scalar_type());
}

// The layer's RMS norm in its dtype: the kernel's fixed-order one in fp32, transformers' in bf16.
torch::Tensor layer_norm(const DecoderLayerPlan& p, const torch::Tensor& x,
                         const torch::Tensor& weight, double eps, const std::string& isa) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "a ", weight.scalar_type(),
              " layer met a ", x.scalar_type(), " stream");
  return x.scalar_type() == torch::kFloat32 ? rms_norm(x.contiguous(), weight, eps, isa)
                                            : hf_rms_norm(x, weight, eps);
}

// The lean body's rotary on bf16 states, op for op (x * cos + swapped halves * signed sin, each
// rounded to bf16 as ATen rounds it). states [B, S, heads, D] contiguous, cos and signed_sin
// [B, S, D] -> [B, S, heads, D].
torch::Tensor rotate_half_bf16(const torch::Tensor& states, const torch::Tensor& cos,
                               const torch::Tensor& signed_sin) {
  const int64_t B = states.size(0), S = states.size(1), H = states.size(2), D = states.size(3);
  const torch::Tensor swapped = states.view({B, S, H, 2, D / 2}).flip({3}).view({B, S, H, D});
  return states * cos.unsqueeze(2) + swapped * signed_sin.unsqueeze(2);
}

DecoderLayerPlan make_plan(torch::Tensor input_norm, double input_eps, torch::Tensor post_norm,
                           double post_eps, std::vector<KernelMatrix> linears, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, double scaling) {
  TORCH_CHECK(linears.size() == 7, "a decoder layer has 7 linear layers (q, k, v, o, gate, up, "
              "down), got ", linears.size());
  check_norm(post_norm, "post-attention norm");
  TORCH_CHECK(input_norm.numel() == 0 || input_norm.scalar_type() == post_norm.scalar_type(),
              "the two norms differ in dtype");
  // An empty input norm: the caller gives the layer's attention input itself, normalised, of any
  // width q/k/v agree on (EAGLE-3's [norm(embedding); norm(feature)], 2H wide; decoder_body).
  const bool given_input = input_norm.numel() == 0;
  if (!given_input) check_norm(input_norm, "input norm");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0,
              "heads must be a positive multiple of kv_heads");
  const int64_t hidden = post_norm.size(0);
  const KernelMatrix &q = linears[0], &k = linears[1], &v = linears[2], &o = linears[3];
  const KernelMatrix &gate = linears[4], &up = linears[5], &down = linears[6];
  TORCH_CHECK(given_input || input_norm.size(0) == hidden, "the two norms differ in size");
  const int64_t width = given_input ? q.K : hidden;
  TORCH_CHECK(q.K == width && k.K == width && v.K == width, "q, k and v must take ", width,
              " features");
  TORCH_CHECK(gate.K == hidden && up.K == hidden, "gate and up must take ", hidden, " features");
  TORCH_CHECK(q.N == heads * head_dim && k.N == kv_heads * head_dim && v.N == kv_heads * head_dim,
              "q, k, v outputs must be heads x head_dim");
  TORCH_CHECK(o.K == heads * head_dim && o.N == hidden, "o must map heads x head_dim to ", hidden);
  TORCH_CHECK(gate.N == up.N && down.K == up.N && down.N == hidden,
              "gate, up and down must map ", hidden, " -> intermediate -> ", hidden);
  return DecoderLayerPlan{std::move(input_norm), std::move(post_norm), input_eps, post_eps,
                          q, k, v, o, gate, up, down, heads, kv_heads, head_dim, scaling};
}

// Low-rank deltas added to a layer's linear outputs (selfspec/linear_deltas.py), one slot per
// linear in plan order (q, k, v, o, gate, up, down); an undefined `a`: nothing to add. `a` 2-D
// [in, r], `b` [r, out]: every row adds x a b; `a` 3-D [B, in, r], `b` [B, r, out]: row i adds
// x[i] a[i] b[i]. The same ATen ops as the hooks that describe them, so the same bits. With
// `segments` (a ragged body: hidden [1, S, H] holding G segments back to back, segment g the
// tokens [offset, offset + length) of each pair), a 3-D delta has one row per segment: segments
// of one length add it as the padded layout does (one batched product), others each with the
// 2-D ops of a forward of its own (a call per segment: dearer in ATen calls, no padding).
struct LayerDeltas {
  torch::Tensor a[7], b[7];
  const std::vector<std::pair<int64_t, int64_t>>* segments = nullptr;
};
const LayerDeltas kNoDeltas{};

// out = w(x) [B, S, out] plus slot's delta, added in place.
torch::Tensor plus_delta(torch::Tensor out, const torch::Tensor& x, const KernelMatrix& w,
                         const LayerDeltas& d, int slot) {
  const torch::Tensor &a = d.a[slot], &b = d.b[slot];
  if (!a.defined()) return out;
  if (a.dim() == 2) {
    out.view({-1, w.N}).addmm_(at::mm(x.reshape({-1, w.K}), a), b);
  } else if (d.segments != nullptr) {
    const auto& segments = *d.segments;
    const int64_t G = static_cast<int64_t>(segments.size()), n = segments[0].second;
    TORCH_CHECK(a.size(0) == G, "a per-segment delta of ", a.size(0), " rows met ", G,
                " segments");
    bool equal = true;
    for (const auto& segment : segments) equal = equal && segment.second == n;
    if (equal) {  // as a batch of G rows of n tokens: the padded layout's ops, one call each
      out.view({G, n, w.N}).baddbmm_(at::bmm(x.reshape({G, n, w.K}), a), b);
    } else {  // each segment as a forward of its own would add it
      const torch::Tensor rows = x.reshape({-1, w.K}), outs = out.view({-1, w.N});
      for (int64_t g = 0; g < G; ++g) {
        const auto [offset, length] = segments[g];
        outs.narrow(0, offset, length)
            .addmm_(at::mm(rows.narrow(0, offset, length), a[g]), b[g]);
      }
    }
  } else {
    TORCH_CHECK(x.dim() == 3 && x.size(0) == a.size(0), "a per-row delta of ", a.size(0),
                " rows met input of shape ", x.sizes());
    out.baddbmm_(at::bmm(x, a), b);
  }
  return out;
}

// x [B, S, in] -> w(x) (+ the delta) [B, S, out].
torch::Tensor linear_plus(const torch::Tensor& x, const KernelMatrix& w, const LayerDeltas& d,
                          int slot, const std::string& isa) {
  return plus_delta(run_linear(x, w, isa), x, w, d, slot);
}

// Layers `slots` of one x (q/k/v; gate/up) in one kernel call (run_linears: x prepared once, one
// parallel region), each plus its delta: what linear_plus gives each.
std::vector<torch::Tensor> linears_plus(const torch::Tensor& x,
                                        const std::vector<const KernelMatrix*>& ws,
                                        const LayerDeltas& d, const std::vector<int>& slots,
                                        const std::string& isa) {
  std::vector<torch::Tensor> outs = run_linears(x, ws, isa);
  for (size_t j = 0; j < outs.size(); ++j) outs[j] = plus_delta(outs[j], x, *ws[j], d, slots[j]);
  return outs;
}

// hidden [B, S, H] -> (query [B, S, heads, D], key [B, kv_heads, S, D], value [B, kv_heads, S, D]):
// the input norm, q/k/v projections and rotary embedding (query and key rotated; key and value
// transposed views, as the cache takes them).
// A plan with an empty input norm reads `given` [B, S, q.K] (already normalised) instead.
std::vector<torch::Tensor> attention_inputs(const DecoderLayerPlan& p, const torch::Tensor& hidden,
                                            const torch::Tensor& cos,
                                            const torch::Tensor& signed_sin,
                                            const std::string& isa,
                                            const LayerDeltas& d = kNoDeltas,
                                            const torch::Tensor& given = torch::Tensor()) {
  TORCH_CHECK(hidden.dim() == 3, "hidden must be [B, S, H]");
  const int64_t B = hidden.size(0), S = hidden.size(1);
  const bool wants_given = p.input_norm.numel() == 0;
  TORCH_CHECK(wants_given == given.defined(), wants_given
                  ? "this layer's plan has no input norm: give its attention input"
                  : "an attention input was given to a layer that normalises its own");
  if (wants_given) {
    TORCH_CHECK(given.dim() == 3 && given.size(0) == B && given.size(1) == S &&
                    given.size(2) == p.q.K && given.scalar_type() == layer_dtype(p),
                "the attention input must be ", layer_dtype(p), " [", B, ", ", S, ", ", p.q.K,
                "], got ", given.scalar_type(), " ", given.sizes());
  }
  const torch::Tensor normed = wants_given
                                   ? given.contiguous()
                                   : layer_norm(p, hidden, p.input_norm, p.input_eps, isa);
  std::vector<torch::Tensor> qkv = linears_plus(normed, {&p.q, &p.k, &p.v}, d, {0, 1, 2}, isa);
  torch::Tensor query = qkv[0].view({B, S, p.heads, p.head_dim});
  torch::Tensor key = qkv[1].view({B, S, p.kv_heads, p.head_dim});
  torch::Tensor value = qkv[2].view({B, S, p.kv_heads, p.head_dim});
  const torch::Tensor c = cos.contiguous(), s = signed_sin.contiguous();
  if (query.scalar_type() == torch::kFloat32) {
    rotary_(query, c, s);
    rotary_(key, c, s);
  } else {
    query = rotate_half_bf16(query, c, s);
    key = rotate_half_bf16(key, c, s);
  }
  return {query, key.transpose(1, 2), value.transpose(1, 2)};
}

// attention(query over keys/values) [B, S, heads, D] in query's dtype (computed in fp32, rounded
// as the kernels' Python wrapper rounds). keys, values [B, kv_heads, T, D] (the cache after this
// step's update); mask [B, S, T] additive, or none (causal).
torch::Tensor attend(const DecoderLayerPlan& p, const torch::Tensor& query, torch::Tensor keys,
                     torch::Tensor values, const c10::optional<torch::Tensor>& mask,
                     const std::string& isa) {
  if (keys.scalar_type() != torch::kBFloat16) keys = keys.to(torch::kFloat32);
  values = values.to(keys.scalar_type());
  const int64_t D = keys.size(-1);
  if (!(keys.strides() == values.strides() && keys.stride(3) == 1 && keys.stride(2) == D)) {
    keys = keys.contiguous();  // read in place only as rows of D, D apart (a cache window is)
    values = values.contiguous();
  }
  c10::optional<torch::Tensor> fixed_mask;
  if (mask.has_value()) fixed_mask = mask->to(torch::kFloat32).contiguous();
  return attention(query.to(torch::kFloat32).contiguous(), keys, values, fixed_mask, p.scaling, isa)
      .to(query.scalar_type());
}

// hidden + o_proj(attended) [B, S, H]; attended [B, S, heads, D].
torch::Tensor output_projection(const DecoderLayerPlan& p, const torch::Tensor& hidden,
                                const torch::Tensor& attended, const std::string& isa,
                                const LayerDeltas& d = kNoDeltas) {
  const int64_t B = attended.size(0), S = attended.size(1);
  return hidden + linear_plus(attended.view({B, S, p.heads * p.head_dim}), p.o, d, 3, isa);
}

// hidden + o_proj(attention(query over keys/values)) [B, S, H] (see attend).
torch::Tensor attention_output(const DecoderLayerPlan& p, const torch::Tensor& hidden,
                               const torch::Tensor& query, torch::Tensor keys, torch::Tensor values,
                               const c10::optional<torch::Tensor>& mask, const std::string& isa) {
  return output_projection(p, hidden, attend(p, query, std::move(keys), std::move(values), mask, isa),
                           isa);
}

// hidden + down(silu(gate(n)) * up(n)), n = post_norm(hidden): the layer's MLP block [B, S, H].
torch::Tensor mlp_block(const DecoderLayerPlan& p, const torch::Tensor& hidden,
                        const std::string& isa, const LayerDeltas& d = kNoDeltas) {
  const torch::Tensor normed = layer_norm(p, hidden, p.post_norm, p.post_eps, isa);
  const std::vector<torch::Tensor> gate_up = linears_plus(normed, {&p.gate, &p.up}, d, {4, 5}, isa);
  const torch::Tensor gated = at::silu(gate_up[0]) * gate_up[1];
  return hidden + linear_plus(gated, p.down, d, 6, isa);
}

// A body's layers, in order: one plan each, held once (a layer's weights change: a new BodyPlan).
struct BodyPlan {
  std::vector<DecoderLayerPlan> layers;
};

BodyPlan make_body_plan(std::vector<DecoderLayerPlan> layers) {
  TORCH_CHECK(!layers.empty(), "a body has at least one decoder layer");
  return BodyPlan{std::move(layers)};
}

// Every layer of a body in one call, for G segments of tokens that each have their own KV
// cache: hidden [B, S, H] -> {the last layer's output [B, S, H] (before the final norm), then the
// stream entering each layer listed in `capture` [B, S, H], in that order} (EAGLE-3's taps read
// those; nothing is copied for them). Without `lengths` each of the B rows is a segment of S
// tokens (G = B, a batch padded to its longest member); with them hidden is [1, S, H] and holds
// G = lengths.size() segments back to back, segment g lengths[g] tokens (ragged: no padding).
// Segment g's cache in layer l is key_buffers[l * G + g] / value_buffers[l * G + g] [1,
// kv_heads, capacity, D] (a row of a batched buffer, or a request's own): the layer writes the
// segment's n = its length new keys and values at [starts[g], starts[g] + n) and the segment
// attends over [0, starts[g] + n) of them, read in place, under masks[g] [1, n, starts[g] + n]
// (additive; none: causal). Linear layers run on all tokens at once, attention segment by
// segment (both are row-invariant: the same bits as each segment's forward of its own). The
// same kernels and ops in the same order as the three calls per layer with the cache update
// between them: the same bits. Per-row deltas (3-D) have one row per segment.
// `attention_input` [B, S, K]: the first layer's attention input when its plan has no input norm
// (EAGLE-3's head: q/k/v read the normalised embedding and feature side by side, while `hidden`,
// the feature, is the residual stream); none otherwise.
std::vector<torch::Tensor> decoder_body(const BodyPlan& body, torch::Tensor hidden,
                                        const torch::Tensor& cos, const torch::Tensor& signed_sin,
                                        const std::vector<torch::Tensor>& key_buffers,
                                        const std::vector<torch::Tensor>& value_buffers,
                                        const std::vector<int64_t>& starts,
                                        const std::vector<c10::optional<torch::Tensor>>& masks,
                                        const std::vector<int64_t>& lengths,
                                        const std::vector<int64_t>& capture,
                                        const std::vector<c10::optional<torch::Tensor>>& delta_a,
                                        const std::vector<c10::optional<torch::Tensor>>& delta_b,
                                        const std::string& isa,
                                        const c10::optional<torch::Tensor>& attention_input) {
  const size_t L = body.layers.size();
  TORCH_CHECK(hidden.dim() == 3, "hidden must be [B, S, H]");
  const int64_t B = hidden.size(0), S = hidden.size(1);
  const bool ragged = !lengths.empty();
  TORCH_CHECK(!ragged || B == 1, "ragged segments come as hidden [1, S, H], got ", hidden.sizes());
  const int64_t G = ragged ? static_cast<int64_t>(lengths.size()) : B;
  // Segment g: (offset, length), its tokens [offset, offset + length) of its row of hidden.
  std::vector<std::pair<int64_t, int64_t>> segments(G);
  int64_t total = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t n = ragged ? lengths[g] : S;
    TORCH_CHECK(n >= 1, "segment ", g, " has ", n, " tokens");
    segments[g] = {ragged ? total : 0, n};
    total += n;
  }
  TORCH_CHECK(!ragged || total == S, "the segments' lengths sum to ", total, ", hidden has ", S,
              " tokens");
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == G && static_cast<int64_t>(masks.size()) == G,
              "one start and one mask per segment: ", G, " segments, ", starts.size(),
              " starts, ", masks.size(), " masks");
  TORCH_CHECK(key_buffers.size() == L * G && value_buffers.size() == L * G, "one key and one "
              "value buffer per layer and segment: ", L, " x ", G, ", got ", key_buffers.size(),
              " and ", value_buffers.size());
  for (const int64_t l : capture) {
    TORCH_CHECK(l >= 0 && l < static_cast<int64_t>(L), "capture: layer ", l, " of ", L);
  }
  TORCH_CHECK((delta_a.empty() && delta_b.empty()) ||
                  (delta_a.size() == 7 * L && delta_b.size() == 7 * L),
              "deltas: none, or 7 per layer (", 7 * L, "), got ", delta_a.size(), " and ",
              delta_b.size());
  std::vector<c10::optional<torch::Tensor>> segment_masks(G);
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(starts[g] >= 0, "segment ", g, ": negative start");
    if (!masks[g].has_value()) continue;
    const torch::Tensor& mask = *masks[g];
    const int64_t n = segments[g].second;
    TORCH_CHECK(mask.dim() == 3 && mask.size(0) == 1 && mask.size(1) == n &&
                    mask.size(2) == starts[g] + n,
                "segment ", g, "'s mask must be [1, ", n, ", ", starts[g] + n, "], got ",
                mask.sizes());
    segment_masks[g] = mask.to(torch::kFloat32).contiguous();
  }
  LayerDeltas deltas;
  if (ragged) deltas.segments = &segments;
  std::vector<torch::Tensor> out(1 + capture.size());
  for (size_t l = 0; l < L; ++l) {
    const DecoderLayerPlan& p = body.layers[l];
    for (size_t j = 0; j < capture.size(); ++j) {  // a layer's input is never changed after
      if (capture[j] == static_cast<int64_t>(l)) out[1 + j] = hidden;
    }
    for (int j = 0; j < 7 && !delta_a.empty(); ++j) {
      const c10::optional<torch::Tensor>&a = delta_a[7 * l + j], &b = delta_b[7 * l + j];
      TORCH_CHECK(a.has_value() == b.has_value(), "layer ", l, " linear ", j, ": a without b");
      deltas.a[j] = a.has_value() ? *a : torch::Tensor();
      deltas.b[j] = b.has_value() ? *b : torch::Tensor();
    }
    const torch::Tensor given =
        l == 0 && attention_input.has_value() ? *attention_input : torch::Tensor();
    std::vector<torch::Tensor> qkv =
        attention_inputs(p, hidden, cos, signed_sin, isa, deltas, given);
    std::vector<torch::Tensor> attended(G);
    for (int64_t g = 0; g < G; ++g) {
      const torch::Tensor &keys = key_buffers[l * G + g], &values = value_buffers[l * G + g];
      const auto [offset, n] = segments[g];
      const int64_t row = ragged ? 0 : g;
      const int64_t start = starts[g], end = start + n;
      TORCH_CHECK(keys.dim() == 4 && keys.size(0) == 1 && keys.size(1) == p.kv_heads &&
                      keys.size(3) == p.head_dim && keys.size(2) >= end &&
                      values.sizes() == keys.sizes() && values.strides() == keys.strides() &&
                      keys.scalar_type() == values.scalar_type(),
                  "layer ", l, ", segment ", g, ": cache buffers must be [1, kv_heads, >= ", end,
                  ", head_dim], alike");
      // query [B, S, heads, D]; key, value [B, kv_heads, S, D]
      keys.narrow(2, start, n).copy_(qkv[1].narrow(0, row, 1).narrow(2, offset, n));
      values.narrow(2, start, n).copy_(qkv[2].narrow(0, row, 1).narrow(2, offset, n));
      attended[g] = attend(p, qkv[0].narrow(0, row, 1).narrow(1, offset, n),
                           keys.narrow(2, 0, end), values.narrow(2, 0, end), segment_masks[g], isa);
    }
    hidden = output_projection(p, hidden, G == 1 ? attended[0] : at::cat(attended, ragged ? 1 : 0),
                               isa, deltas);
    hidden = mlp_block(p, hidden, isa, deltas);
  }
  out[0] = hidden;
  return out;
}

}  // namespace

void register_decoder_layer(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<KernelMatrix>(m, "KernelMatrix")
      .def(py::init<int64_t, torch::Tensor, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, int64_t,
                    int64_t>(),
           py::arg("format"), py::arg("weight"), py::arg("scale"), py::arg("minimum"),
           py::arg("bias"), py::arg("group"), py::arg("out_features"))
      .def_readonly("N", &KernelMatrix::N)
      .def_readonly("K", &KernelMatrix::K);
  py::class_<DecoderLayerPlan>(m, "DecoderLayerPlan")
      .def(py::init(&make_plan), py::arg("input_norm"), py::arg("input_eps"), py::arg("post_norm"),
           py::arg("post_eps"), py::arg("linears"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("scaling"));
  py::class_<BodyPlan>(m, "BodyPlan").def(py::init(&make_body_plan), py::arg("layers"));
  m.def("decoder_body", &decoder_body);
  m.def("attention_inputs", [](const DecoderLayerPlan& p, const torch::Tensor& hidden,
                               const torch::Tensor& cos, const torch::Tensor& signed_sin,
                               const std::string& isa) {
    return attention_inputs(p, hidden, cos, signed_sin, isa);
  });
  m.def("attention_output", [](const DecoderLayerPlan& p, const torch::Tensor& hidden,
                               const torch::Tensor& query, torch::Tensor keys, torch::Tensor values,
                               const c10::optional<torch::Tensor>& mask, const std::string& isa) {
    return attention_output(p, hidden, query, std::move(keys), std::move(values), mask, isa);
  });
  m.def("mlp_block", [](const DecoderLayerPlan& p, const torch::Tensor& hidden,
                        const std::string& isa) { return mlp_block(p, hidden, isa); });
}

}  // namespace selfspec_kernels

// The torch-facing kernel calls (ops.cpp), for the other torch-facing files (decoder_layer.cpp).
#pragma once
#include <torch/extension.h>

#include <string>

namespace selfspec_kernels {

// A linear layer's weight as the kernel reads it, checked once when made. `weight` by format
// (params.h): fp32 / bf16 / int8 [N, K], or uint8 [N, K / 32, 16] for q4_1; `scale` [N, groups]
// (int8, q4_1), `minimum` [N, K / 32] (q4_1), `bias` [N] fp32; `group`: elements per int8 scale.
// The *_A8 / *_A24 formats are interleaved by 16 columns, their scales and minimums grouped
// the same way ([ceil(N / 16), rows, 16], params.h): N is `out_features`, not in their shapes.
struct KernelMatrix {
  KernelMatrix(int64_t format, torch::Tensor weight, c10::optional<torch::Tensor> scale,
               c10::optional<torch::Tensor> minimum, c10::optional<torch::Tensor> bias,
               int64_t group, int64_t out_features);
  int64_t format, group;
  int64_t N = 0, K = 0;
  torch::Tensor weight;
  c10::optional<torch::Tensor> scale, minimum, bias;
};

// x [..., K] fp32 -> x . w^T (+ bias) [..., N] fp32, each output element in one fixed order;
// `rows` (int64 [N'], optional): only those weight rows, y [..., N'].
torch::Tensor run_linear(const torch::Tensor& x, const KernelMatrix& w, const std::string& isa,
                         const c10::optional<torch::Tensor>& rows = {});

// run_linear through each of `ws` (layers reading the same x: q/k/v, gate/up), x prepared once
// (converted, quantized or reordered) and every output column in one parallel region: each
// output has run_linear's bits.
std::vector<torch::Tensor> run_linears(const torch::Tensor& x, const std::vector<const KernelMatrix*>& ws,
                                       const std::string& isa);

// q [B, S, H, D] fp32; k, v [B, Hkv, T, D] fp32 or bf16, rows of D contiguous, the same strides;
// mask [B, S, T] additive fp32 or none (causal). -> [B, S, H, D] fp32.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const c10::optional<torch::Tensor>& mask, double scale,
                        const std::string& isa);

// x [..., H] fp32 -> weight * (x * rsqrt(mean(x^2) + eps)), each row in a fixed order.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       const std::string& isa);

// x [B, S, heads, D] fp32 contiguous, in place: x * cos + swap_halves(x) * signed_sin.
void rotary_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin);

// decoder_layer.cpp's classes and calls, added to the module.
void register_decoder_layer(pybind11::module& m);

}  // namespace selfspec_kernels

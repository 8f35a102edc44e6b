// The torch-facing side: argument checks, instruction-set dispatch and threads over output
// columns (linear) or (batch, query, head) items (attention), through torch's own thread pool.
#include <ATen/Parallel.h>
#include <xmmintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <torch/extension.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ops.h"
#include "params.h"

namespace selfspec_kernels {
namespace avx512 {
void linear_columns(const LinearParams& p, int64_t n_begin, int64_t n_end, float* scratch);
void attention_groups(const AttentionParams& p, int64_t begin, int64_t end, float* scratch);
void rms_norm_rows(const NormParams& p, int64_t begin, int64_t end);
void quantize_rows(const LinearParams& p, int8_t* xq, float* scales, float* sums, int32_t* corr,
                   int64_t begin, int64_t end);
void quantize_rows_a24(const LinearParams& p, int8_t* xq, float* scales, float* sums,
                       int32_t* corr, int64_t begin, int64_t end);
}  // namespace avx512
namespace amx {
void linear_columns_amx(const LinearParams& p, int64_t n_begin, int64_t n_end);
}  // namespace amx
namespace avx512bf16 {
void linear_columns_bf16(const LinearParams& p, int64_t n_begin, int64_t n_end);
}  // namespace avx512bf16
namespace avx2 {
void linear_columns(const LinearParams& p, int64_t n_begin, int64_t n_end, float* scratch);
void attention_groups(const AttentionParams& p, int64_t begin, int64_t end, float* scratch);
void rms_norm_rows(const NormParams& p, int64_t begin, int64_t end);
void quantize_rows(const LinearParams& p, int8_t* xq, float* scales, float* sums, int32_t* corr,
                   int64_t begin, int64_t end);
void quantize_rows_a24(const LinearParams& p, int8_t* xq, float* scales, float* sums,
                       int32_t* corr, int64_t begin, int64_t end);
}  // namespace avx2

namespace {

bool cpu_has(const char* isa) {
  __builtin_cpu_init();
  if (std::string(isa) == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma");
  }
  if (std::string(isa) == "avx512vnni") {
    return cpu_has("avx512") && __builtin_cpu_supports("avx512vnni");
  }
  if (std::string(isa) == "avx512bf16") {
    return cpu_has("avx512") && __builtin_cpu_supports("avx512bf16");
  }
  if (std::string(isa) == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  return false;
}

// bf16 dot products (isa_avx512bf16.cpp) for bf16 weights: the CPU has AVX-512 BF16 and
// SELFSPEC_KERNEL_BF16 is not "0" (read on every call; the same bits either way).
bool bf16_dot_ready() {
  const char* env = std::getenv("SELFSPEC_KERNEL_BF16");
  if (env != nullptr && std::string(env) == "0") return false;
  return cpu_has("avx512bf16");
}

// x [M, K] (fp32, or bf16 bits when `x_bf16`) into `ordered` (may be null) as fp32 in the bf16
// format's order (params.h): per block of 32, its 16 odd elements then its 16 even ones, zeros to
// bf16_length(K); into `bits` (may be null) as bf16 bits in their own order, for the dot-product
// instruction. Returns whether every element of x is a bf16 value (its low 16 bits zero), i.e.
// whether `bits` holds x exactly.
bool bf16_order(const void* x, bool x_bf16, int64_t M, int64_t K, float* ordered, uint16_t* bits) {
  const int64_t length = bf16_length(K);
  uint32_t low_bits = 0;
  for (int64_t m = 0; m < M; ++m) {
    float* out = ordered ? ordered + m * length : nullptr;
    uint16_t* out_bits = bits ? bits + m * length : nullptr;
    for (int64_t k = 0; k < length; ++k) {
      uint32_t word = 0;
      if (k < K && x_bf16) {
        word = uint32_t{static_cast<const uint16_t*>(x)[m * K + k]} << 16;
      } else if (k < K) {
        std::memcpy(&word, static_cast<const float*>(x) + m * K + k, sizeof word);
      }
      if (out) {
        const int64_t block = k / 32, j = k % 32;
        std::memcpy(out + 32 * block + (j % 2 ? j / 2 : 16 + j / 2), &word, sizeof word);
      }
      low_bits |= word & 0xFFFFu;
      if (out_bits) out_bits[k] = static_cast<uint16_t>(word >> 16);
    }
  }
  return low_bits == 0;
}

// Flush-to-zero and denormals-are-zero for this thread while alive: the bf16 format's arithmetic
// (vdpbf16ps ignores MXCSR and flushes; every path of the format sets these, so all flush alike).
class FlushDenormals {
 public:
  explicit FlushDenormals(bool on) : saved_(_mm_getcsr()), on_(on) {
    if (on_) _mm_setcsr(saved_ | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
  }
  ~FlushDenormals() {
    if (on_) _mm_setcsr(saved_);
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned saved_;
  bool on_;
};

// AMX tiles for the integer-activation formats (isa_amx.cpp): the CPU has amx-tile and amx-int8
// (CPUID leaf 7, EDX bits 24 and 25), Linux grants this process the tile state (arch_prctl), and
// SELFSPEC_KERNEL_AMX is not "0" (read on every call; the hardware and the OS asked once).
bool amx_ready() {
  const char* env = std::getenv("SELFSPEC_KERNEL_AMX");
  if (env != nullptr && std::string(env) == "0") return false;
  static const bool ready = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 24) & 1) || !((edx >> 25) & 1) || !cpu_has("avx512vnni")) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ready;
}

// "auto" picks the widest path the CPU runs; a named path must be supported.
std::string resolve_isa(const std::string& isa) {
  if (isa == "auto") {
    if (cpu_has("avx512")) return "avx512";
    if (cpu_has("avx2")) return "avx2";
    TORCH_CHECK(false, "selfspec kernels need AVX2 with FMA; this CPU has neither AVX2 nor AVX-512");
  }
  TORCH_CHECK(isa == "avx512" || isa == "avx2", "unknown instruction set '", isa,
              "': expected auto, avx512 or avx2");
  TORCH_CHECK(cpu_has(isa.c_str()), "this CPU cannot run the ", isa, " path");
  return isa;
}

void check_on_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

void check_cpu(const torch::Tensor& t, const char* name) {
  check_on_cpu(t, name);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

bool amx_available() { return amx_ready(); }
bool vnni_available() { return cpu_has("avx512vnni"); }
bool bf16_dot_available() { return bf16_dot_ready(); }

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  if (cpu_has("avx512")) out.push_back("avx512");
  if (cpu_has("avx2")) out.push_back("avx2");
  return out;
}

KernelMatrix::KernelMatrix(int64_t format_, torch::Tensor weight_,
                           c10::optional<torch::Tensor> scale_,
                           c10::optional<torch::Tensor> minimum_,
                           c10::optional<torch::Tensor> bias_, int64_t group_, int64_t out_features)
    : format(format_), group(group_), weight(std::move(weight_)), scale(std::move(scale_)),
      minimum(std::move(minimum_)), bias(std::move(bias_)) {
  check_cpu(weight, "weight");
  TORCH_CHECK(weight.dim() >= 2, "weight must be [N, ...], got ", weight.dim(), " dimensions");
  N = out_features;
  TORCH_CHECK(N >= 0, "a weight's output features cannot be negative, got ", N);
  // An interleaved weight's scale and min tables: [ceil(N / 16), rows, 16] (params.h).
  auto check_grouped = [&](const c10::optional<torch::Tensor>& table, const char* name,
                           int64_t rows) {
    TORCH_CHECK(table.has_value(), "an interleaved weight needs its ", name);
    check_cpu(*table, name);
    TORCH_CHECK(table->scalar_type() == torch::kFloat32 && table->dim() == 3 &&
                    table->size(0) == (N + 15) / 16 && table->size(1) == rows &&
                    table->size(2) == 16,
                "interleaved ", name, " must be float32 [", (N + 15) / 16, ", ", rows,
                ", 16] (N = ", N, "), got ", table->scalar_type(), " ", table->sizes());
  };
  if (integer_activations(format)) {  // interleaved by 16 columns: [G, K / 32, runs, 64]
    const bool q4 = stored_format(format) == kQ4_1;
    TORCH_CHECK(weight.scalar_type() == (q4 ? torch::kUInt8 : torch::kInt8) && weight.dim() == 4 &&
                    weight.size(0) == (N + 15) / 16 && weight.size(2) == (q4 ? 4 : 8) &&
                    weight.size(3) == 64,
                q4 ? "q4_1_a8 / q4_1_a24 weight must be uint8 [" : "int8_a8 / int8_a24 weight must be int8 [",
                (N + 15) / 16, ", K / 32, ", q4 ? 4 : 8, ", 64] (N = ", N, "), got ",
                weight.scalar_type(), " ", weight.sizes());
    K = weight.size(1) * 32;
    if (q4) {
      check_grouped(scale, "scale", K / 32);
      check_grouped(minimum, "min", K / 32);
    } else {
      TORCH_CHECK(group >= K || (group >= 32 && (group & (group - 1)) == 0),
                  "interleaved int8 group must be K or a power of two >= 32, got ", group);
      check_grouped(scale, "scale", group >= K ? 1 : (K + group - 1) / group);
    }
  } else {
    TORCH_CHECK(weight.size(0) == N, "a weight of ", N, " output features has ", weight.size(0),
                " rows");
    switch (stored_format(format)) {
      case kFloat32:
        TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.dim() == 2,
                    "float32 weight must be [N, K] float32");
        K = weight.size(1);
        break;
      case kBFloat16:
        TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.dim() == 2,
                    "bfloat16 weight must be [N, K] bfloat16");
        K = weight.size(1);
        break;
      case kInt8: {
        TORCH_CHECK(weight.scalar_type() == torch::kInt8 && weight.dim() == 2, "int8 weight must be [N, K] int8");
        K = weight.size(1);
        TORCH_CHECK(group >= K || (group >= 16 && (group & (group - 1)) == 0),
                    "int8 group must be K or a power of two >= 16, got ", group);
        TORCH_CHECK(scale.has_value(), "int8 weight needs a scale");
        const int64_t groups = group >= K ? 1 : (K + group - 1) / group;
        check_cpu(*scale, "scale");
        TORCH_CHECK(scale->scalar_type() == torch::kFloat32 && scale->numel() == N * groups,
                    "int8 scale must be float32 [N, ", groups, "]");
        break;
      }
      case kQ4_1: {
        TORCH_CHECK(weight.scalar_type() == torch::kUInt8 && N > 0 && weight.numel() % (N * 16) == 0,
                    "q4_1 weight must be uint8 [N, K / 32, 16]");
        K = weight.numel() / N * 2;
        TORCH_CHECK(scale.has_value() && minimum.has_value(), "q4_1 weight needs scale and min");
        check_cpu(*scale, "scale");
        check_cpu(*minimum, "min");
        TORCH_CHECK(scale->scalar_type() == torch::kFloat32 && scale->numel() == N * (K / 32) &&
                        minimum->scalar_type() == torch::kFloat32 && minimum->numel() == N * (K / 32),
                    "q4_1 scale and min must be float32 [N, K / 32]");
        break;
      }
      default:
        TORCH_CHECK(false, "unknown weight format ", format);
    }
  }
  TORCH_CHECK(format >= kFloat32 && format <= kInt8_A24, "unknown weight format ", format);
  if (integer_activations(format)) {
    TORCH_CHECK(K % 32 == 0, "int8 activations need K divisible by 32, got ", K);
    TORCH_CHECK(stored_format(format) != kInt8 || group >= K || group % 32 == 0,
                "int8 activations need int8 weight groups of a multiple of 32, got ", group);
  }
  if (bias.has_value()) {
    check_cpu(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->numel() == N, "bias must be float32 [N]");
  }
}

namespace {

// x as the kernels of one weight format read it, made once for every layer of that format that
// reads this x (q/k/v, gate/up: run_linears): fp32 (a bf16 x converted, except for the bf16
// format), the bf16 format's reordered copy, or the integer-activation formats' codes and
// scales. `base` holds x's fields of the kernels' parameters; the weight's are set per layer.
struct PreparedInput {
  torch::Tensor x, codes, scales, sums, corr, ordered, bits;  // what `base` points into
  LinearParams base{};
  bool bf16_in = false, wide = false, dot_path = false;
};

PreparedInput prepare_input(const torch::Tensor& x_given, const KernelMatrix& w,
                            const std::string& isa) {
  check_cpu(x_given, "x");
  TORCH_CHECK(x_given.dim() >= 1 && (x_given.scalar_type() == torch::kFloat32 ||
                                     x_given.scalar_type() == torch::kBFloat16),
              "x must be a float32 or bfloat16 tensor [..., K]");
  TORCH_CHECK(x_given.size(-1) == w.K, "x has ", x_given.size(-1), " features, the weight takes ",
              w.K);
  const int64_t format = w.format;
  PreparedInput in;
  in.bf16_in = x_given.scalar_type() == torch::kBFloat16;
  // The bf16 format reads bf16 bits itself (bf16_order); the others read fp32.
  in.x = in.bf16_in && format != kBFloat16 ? x_given.to(torch::kFloat32) : x_given;
  const torch::Tensor& x = in.x;
  LinearParams& p = in.base;
  p.K = x.size(-1);
  p.M = p.K == 0 ? 0 : x.numel() / p.K;
  p.format = format;
  p.x = in.bf16_in && format == kBFloat16 ? nullptr : x.data_ptr<float>();  // bf16: set below
  const int64_t M = p.M, K = p.K;
  in.wide = resolve_isa(isa) == "avx512";
  if (M == 0) return in;
  if (integer_activations(format)) {
    // The AVX-512 integer path needs VNNI; without it the AVX2 path (the same bits) runs.
    in.wide = in.wide && cpu_has("avx512vnni");
    const bool wide = in.wide;
    const int64_t planes = activation_planes(format);
    in.codes = torch::empty({planes, M, K}, x.options().dtype(torch::kInt8));
    in.scales = torch::empty({M, K / 32}, x.options());
    in.sums = torch::empty({M, K / 32}, x.options());
    in.corr = torch::empty({planes, M, K / 32}, x.options().dtype(torch::kInt32));
    int8_t* c = in.codes.data_ptr<int8_t>();
    float *l = in.scales.data_ptr<float>(), *s = in.sums.data_ptr<float>();
    int32_t* r = in.corr.data_ptr<int32_t>();
    at::parallel_for(0, M, std::max<int64_t>(1, 4096 / K), [&](int64_t begin, int64_t end) {
      if (planes == 3) {
        if (wide) avx512::quantize_rows_a24(p, c, l, s, r, begin, end);
        else avx2::quantize_rows_a24(p, c, l, s, r, begin, end);
      } else if (wide) {
        avx512::quantize_rows(p, c, l, s, r, begin, end);
      } else {
        avx2::quantize_rows(p, c, l, s, r, begin, end);
      }
    });
    p.xq = c;
    p.x_scales = l;
    p.x_sums = s;
    p.x_corr = r;
  }
  if (format == kBFloat16) {  // x in the bf16 weights' order (and as bf16 bits)
    const int64_t length = bf16_length(K);
    const bool dots = in.wide && bf16_dot_ready();
    // A bf16 x on the dot products needs no fp32 copy: it is bf16-valued by its type.
    if (!(dots && in.bf16_in)) {
      in.ordered = torch::empty({M, length}, x.options().dtype(torch::kFloat32));
    }
    if (dots) in.bits = torch::empty({M, length}, x.options().dtype(torch::kInt16));
    const bool exact = bf16_order(
        x.data_ptr(), in.bf16_in, M, K,
        in.ordered.defined() ? in.ordered.data_ptr<float>() : nullptr,
        dots ? reinterpret_cast<uint16_t*>(in.bits.data_ptr<int16_t>()) : nullptr);
    if (in.ordered.defined()) p.x = in.ordered.data_ptr<float>();
    in.dot_path = dots && exact;
    if (in.dot_path) p.x_bf16 = reinterpret_cast<const uint16_t*>(in.bits.data_ptr<int16_t>());
  }
  return in;
}

// The kernels' parameters for `in` through `w` (over the weight rows `rows` only, if given), and
// the fp32 output they fill, y [..., N] (N: the rows').
LinearParams weight_params(const PreparedInput& in, const KernelMatrix& w,
                           const c10::optional<torch::Tensor>& rows, torch::Tensor& y) {
  LinearParams p = in.base;
  TORCH_CHECK(w.format == p.format, "a ", w.format, " weight met x prepared for ", p.format);
  TORCH_CHECK(p.K == w.K, "x has ", p.K, " features, the weight takes ", w.K);
  int64_t N = w.N;
  if (rows.has_value()) {
    check_cpu(*rows, "rows");
    TORCH_CHECK(rows->dim() == 1 && rows->scalar_type() == torch::kInt64, "rows must be int64 [N']");
    TORCH_CHECK(!w.bias.has_value(), "a row-selected linear takes no bias (add bias[rows] after)");
    TORCH_CHECK(!integer_activations(w.format), "a row-selected linear does not take interleaved "
                "weights (q4_1_a8, int8_a8, q4_1_a24, int8_a24: columns interleaved by 16): select "
                "their rows first (ops.linear_rows)");
    N = rows->numel();
    if (N > 0) {
      const int64_t low = rows->min().item<int64_t>(), high = rows->max().item<int64_t>();
      TORCH_CHECK(low >= 0 && high < w.N, "rows must lie in [0, ", w.N, "), got [", low, ", ",
                  high, "]");
    }
    p.rows = rows->data_ptr<int64_t>();
  }
  p.N = N;
  p.group = w.group;
  p.group_shift = -1;
  if (w.group < p.K) {
    while ((int64_t{1} << (p.group_shift + 1)) <= w.group) ++p.group_shift;
  }
  p.w = w.weight.data_ptr();
  if (w.scale.has_value()) p.scale = w.scale->data_ptr<float>();
  if (w.minimum.has_value()) p.minimum = w.minimum->data_ptr<float>();
  if (w.bias.has_value()) p.bias = w.bias->data_ptr<float>();
  std::vector<int64_t> out_shape(in.x.sizes().begin(), in.x.sizes().end());
  out_shape.back() = N;
  y = torch::empty(out_shape, in.x.options().dtype(torch::kFloat32));
  p.y = y.data_ptr<float>();
  return p;
}

// Every output column of the layers `ps` (all reading `in`), in one parallel region over their
// column tiles together: a column's bits do not depend on its tile, its thread or its neighbours.
void run_columns(const PreparedInput& in, const std::vector<LinearParams>& ps) {
  const LinearParams& base = in.base;
  const int64_t M = base.M, K = base.K, format = base.format;
  if (M == 0) return;
  // The integer-activation formats on AMX tiles from enough rows (the same bits; fewer: VNNI).
  const bool tiles_path =
      in.wide && integer_activations(format) && M >= amx_min_rows(format) && amx_ready();
  // Tiles of 4 columns (a multiple of both paths' tile width), of 16 for interleaved groups.
  const int64_t width = integer_activations(format) ? 16 : 4;
  std::vector<int64_t> first_tile(ps.size() + 1, 0);  // layer j's tiles: [first[j], first[j+1])
  int64_t scratch_size = 0;
  for (size_t j = 0; j < ps.size(); ++j) {
    first_tile[j + 1] = first_tile[j] + (ps[j].N + width - 1) / width;
    scratch_size = std::max(scratch_size, linear_scratch_floats(ps[j]));
  }
  const int64_t tiles = first_tile.back();
  if (tiles == 0) return;
  // Enough work per task that a small layer stays on one thread.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, width * K * M));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(scratch_size);
    const FlushDenormals flush(format == kBFloat16);
    for (size_t j = 0; j < ps.size(); ++j) {
      const int64_t from = std::max(begin, first_tile[j]), to = std::min(end, first_tile[j + 1]);
      if (from >= to) continue;
      const LinearParams& p = ps[j];
      const int64_t n_begin = (from - first_tile[j]) * width;
      const int64_t n_end = std::min(p.N, (to - first_tile[j]) * width);
      if (in.dot_path) avx512bf16::linear_columns_bf16(p, n_begin, n_end);
      else if (tiles_path) amx::linear_columns_amx(p, n_begin, n_end);
      else if (in.wide) avx512::linear_columns(p, n_begin, n_end, scratch.data());
      else avx2::linear_columns(p, n_begin, n_end, scratch.data());
    }
  });
}

// y as the caller gets it: in bf16 for a bf16 x (rounded as .to rounds), else fp32.
torch::Tensor finished(const PreparedInput& in, const torch::Tensor& y) {
  return in.bf16_in ? y.to(torch::kBFloat16) : y;
}

}  // namespace

// x [..., K] fp32 (any leading dimensions: M = their product) -> y [..., N] fp32; with `rows`
// (int64 [N'], each in [0, N)) -> y [..., N'], column j read from weight row rows[j]. A bf16 x
// (a bf16 model's activations) computes as its exact fp32 values and gives y in bf16, rounded as
// torch's .to(bfloat16) rounds: what converting on either side in Python gives, without the
// two conversions' dispatch (~420 per token of a 30-layer model).
torch::Tensor run_linear(const torch::Tensor& x_given, const KernelMatrix& w,
                         const std::string& isa, const c10::optional<torch::Tensor>& rows) {
  const PreparedInput in = prepare_input(x_given, w, isa);
  torch::Tensor y;
  const LinearParams p = weight_params(in, w, rows, y);
  run_columns(in, {p});
  return finished(in, y);
}

std::vector<torch::Tensor> run_linears(const torch::Tensor& x_given,
                                       const std::vector<const KernelMatrix*>& ws,
                                       const std::string& isa) {
  TORCH_CHECK(!ws.empty(), "run_linears needs at least one weight");
  for (const KernelMatrix* w : ws) {
    if (w->format != ws[0]->format) {  // nothing to share: one call each
      std::vector<torch::Tensor> out;
      for (const KernelMatrix* each : ws) out.push_back(run_linear(x_given, *each, isa));
      return out;
    }
  }
  const PreparedInput in = prepare_input(x_given, *ws[0], isa);
  std::vector<torch::Tensor> ys(ws.size());
  std::vector<LinearParams> ps;
  for (size_t j = 0; j < ws.size(); ++j) ps.push_back(weight_params(in, *ws[j], {}, ys[j]));
  run_columns(in, ps);
  for (torch::Tensor& y : ys) y = finished(in, y);
  return ys;
}

// `weight` by format: fp32 / bf16 / int8 [N, K], or uint8 [N, K / 32, 16] for q4_1; `scale`
// [N, groups] (int8, q4_1), `minimum` [N, K / 32] (q4_1); the interleaved formats' as params.h
// says (their N, `out_features`, not in their shapes). The matrix is checked on every call:
// a layer called many times holds a KernelMatrix instead (decoder_layer.cpp).
torch::Tensor linear(const torch::Tensor& x, int64_t format, const torch::Tensor& weight,
                     const c10::optional<torch::Tensor>& scale,
                     const c10::optional<torch::Tensor>& minimum,
                     const c10::optional<torch::Tensor>& bias, int64_t group,
                     int64_t out_features, const std::string& isa) {
  return run_linear(x, KernelMatrix(format, weight, scale, minimum, bias, group, out_features),
                    isa, {});
}

// linear over the weight rows `rows` only (int64 [N']): y [..., N'], column j = x . w[rows[j]];
// each column's bits are those of the full linear's column rows[j].
torch::Tensor linear_rows(const torch::Tensor& x, int64_t format, const torch::Tensor& weight,
                          const c10::optional<torch::Tensor>& scale,
                          const c10::optional<torch::Tensor>& minimum, int64_t group,
                          const torch::Tensor& rows, const std::string& isa) {
  // Interleaved weights are refused there (run_linear): the weight's rows are its outputs.
  return run_linear(x, KernelMatrix(format, weight, scale, minimum, {}, group, weight.size(0)),
                    isa, rows);
}

// q [B, S, H, D] fp32; k, v [B, Hkv, T, D] fp32 or bf16; mask [B, S, T] fp32 additive (<= -1e30
// masked) or none (causal: query s sees keys up to T - S + s). -> [B, S, H, D] fp32.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const c10::optional<torch::Tensor>& mask, double scale,
                        const std::string& isa) {
  check_cpu(q, "query");
  check_on_cpu(k, "key");  // strides checked below
  check_on_cpu(v, "value");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32, "query must be [B, S, H, D] float32");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(),
              "key and value must be [B, Hkv, T, D] of one shape and dtype");
  TORCH_CHECK(k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16,
              "key and value must be float32 or bfloat16");
  AttentionParams p{};
  p.B = q.size(0);
  p.S = q.size(1);
  p.H = q.size(2);
  p.D = q.size(3);
  p.Hkv = k.size(1);
  p.T = k.size(2);
  TORCH_CHECK(k.size(0) == p.B && k.size(3) == p.D, "key must be [", p.B, ", Hkv, T, ", p.D, "]");
  TORCH_CHECK(p.Hkv > 0 && p.H % p.Hkv == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(p.D <= 128, "head size above 128 is not supported, got ", p.D);
  TORCH_CHECK(p.T >= p.S, "fewer keys than queries");
  // Keys and values may be a window of a longer cache ([B, Hkv, capacity, D] sliced along T):
  // each key row of D elements contiguous, rows D apart, any batch and head strides.
  TORCH_CHECK(k.strides() == v.strides() && k.stride(3) == 1 && k.stride(2) == p.D,
              "key and value need the same strides, with contiguous rows of D elements");
  p.kv_batch_stride = k.stride(0);
  p.kv_head_stride = k.stride(1);
  p.scale = static_cast<float>(scale);
  p.kv_bf16 = k.scalar_type() == torch::kBFloat16;
  p.q = q.data_ptr<float>();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  if (mask.has_value()) {
    check_cpu(*mask, "mask");
    TORCH_CHECK(mask->scalar_type() == torch::kFloat32 && mask->dim() == 3 && mask->size(0) == p.B &&
                    mask->size(1) == p.S && mask->size(2) == p.T,
                "mask must be float32 [B, S, T] = [", p.B, ", ", p.S, ", ", p.T, "]");
    p.mask = mask->data_ptr<float>();
  }
  auto out = torch::empty_like(q);
  p.out = out.data_ptr<float>();
  const int64_t groups = p.B * p.S * p.Hkv;  // the query heads of one key/value head together
  if (groups == 0) return out;
  const bool wide = resolve_isa(isa) == "avx512";
  const int64_t work = p.T * p.D * (p.H / p.Hkv);
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, work));
  const int64_t scratch_size = attention_scratch_floats(p);
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(scratch_size);
    if (wide) avx512::attention_groups(p, begin, end, scratch.data());
    else avx2::attention_groups(p, begin, end, scratch.data());
  });
  return out;
}

// x [..., H] fp32 -> weight * (x * rsqrt(mean(x^2) + eps)) [..., H], each row in a fixed order.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       const std::string& isa) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat32, "x must be a float32 tensor [..., H]");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.dim() == 1 && weight.size(0) == H,
              "norm weight must be float32 [", H, "]");
  NormParams p{};
  p.x = x.data_ptr<float>();
  p.weight = weight.data_ptr<float>();
  p.H = H;
  p.rows = H == 0 ? 0 : x.numel() / H;
  p.eps = static_cast<float>(eps);
  auto out = torch::empty_like(x);
  p.out = out.data_ptr<float>();
  if (p.rows == 0) return out;
  const bool wide = resolve_isa(isa) == "avx512";
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, H));
  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) {
    if (wide) avx512::rms_norm_rows(p, begin, end);
    else avx2::rms_norm_rows(p, begin, end);
  });
  return out;
}

// Rotary embedding as transformers applies it, elementwise: out = x * cos + swap_halves(x) *
// signed_sin (sin with its first half negated), two products and a sum, each rounded once
// (-ffp-contract=off), the same bits as those torch ops. x [B, S, heads, D] fp32 contiguous;
// cos, signed_sin [B, S, D] fp32 contiguous. In place.
void rotary_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin) {
  check_cpu(x, "x");
  check_cpu(cos, "cos");
  check_cpu(signed_sin, "sin");
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == torch::kFloat32, "x must be float32 [B, S, heads, D]");
  const int64_t B = x.size(0), S = x.size(1), heads = x.size(2), D = x.size(3);
  TORCH_CHECK(D % 2 == 0, "rotary needs an even head size, got ", D);
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && signed_sin.scalar_type() == torch::kFloat32 &&
                  cos.numel() == B * S * D && signed_sin.numel() == B * S * D,
              "cos and sin must be float32 [", B, ", ", S, ", ", D, "]");
  float* data = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = signed_sin.data_ptr<float>();
  const int64_t half = D / 2;
  std::vector<float> swapped(D);
  for (int64_t bs = 0; bs < B * S; ++bs) {
    const float* cr = c + bs * D;
    const float* sr = s + bs * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* row = data + (bs * heads + h) * D;
      for (int64_t d = 0; d < half; ++d) {
        swapped[d] = row[d + half];
        swapped[d + half] = row[d];
      }
      for (int64_t d = 0; d < D; ++d) {
        const float a = row[d] * cr[d];
        const float b = swapped[d] * sr[d];
        row[d] = a + b;
      }
    }
  }
}

}  // namespace selfspec_kernels

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "selfspec's row-invariant small-M linear and fixed-order attention kernels";
  m.def("supported_isas", &selfspec_kernels::supported_isas);
  m.def("amx_ready", &selfspec_kernels::amx_available,
        "whether integer-activation calls of several rows run on AMX tiles here "
        "(SELFSPEC_KERNEL_AMX=0: off)");
  m.def("vnni_ready", &selfspec_kernels::vnni_available,
        "whether the AVX-512 path has VNNI integer dot products here");
  m.def("bf16_dot_ready", &selfspec_kernels::bf16_dot_available,
        "whether bf16 weights with bf16-valued activations run on AVX-512 BF16 dot products "
        "here (SELFSPEC_KERNEL_BF16=0: off; the same bits either way)");
  m.def("linear", &selfspec_kernels::linear);
  m.def("linear_rows", &selfspec_kernels::linear_rows);
  m.def("attention", &selfspec_kernels::attention);
  m.def("rms_norm", &selfspec_kernels::rms_norm);
  m.def("rotary_", &selfspec_kernels::rotary_);
  selfspec_kernels::register_decoder_layer(m);
}

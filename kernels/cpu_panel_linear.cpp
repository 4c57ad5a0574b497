// Projections x W^T on the CPU over a weight laid out once in panels of columns: float32, and bfloat16
// where the CPU has AVX-512's bfloat16 dot products.
//
// A panel holds NR of W's rows (the product's columns) for every input, input by input: (K, NR),
// contiguous, the panels one after the other. A tile of MR rows of x by a panel's NR columns keeps its
// sums in registers (MR x 3 vectors), each input adding one broadcast of x times the panel's three
// vectors there. A thread walks its share of the panels in order, every row block over each panel, so
// the weights stream from memory once a call; while it works on a panel it asks for the next one a few
// cache lines at a time, spread over the panel's work, so that its reads from memory overlap the
// arithmetic instead of waiting between panels, as oneDNN's packed products were measured to (a
// SmolLM2 layer's four products at 64 rows took 0.82 of oneDNN's time, 2-core Zen 4).
//
// A bfloat16 panel holds its columns' inputs in pairs, (ceil(K / 2), NR, 2): one vdpbf16ps adds a pair
// of inputs times a pair of weights into each column's float32 sum, twice float32's products an
// instruction; the sums are rounded to bfloat16 once, at the end, as oneDNN's bfloat16 products do.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>

namespace {

// The registers, raw: held in at::vec's class, the sums went to the stack between steps.
#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;
inline Reg load(const float* p) { return _mm512_loadu_ps(p); }
inline Reg broadcast(float v) { return _mm512_set1_ps(v); }
inline Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(CPU_CAPABILITY_AVX2)
using Reg = __m256;
inline Reg load(const float* p) { return _mm256_loadu_ps(p); }
inline Reg broadcast(float v) { return _mm256_set1_ps(v); }
inline Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
#else
#error "the panel projection needs AVX2 or AVX-512"
#endif

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
static_assert(sizeof(Reg) == kVec * sizeof(float), "at::vec's width is the registers'");
constexpr int64_t NR = 3 * kVec;                 // a panel's columns: three vectors
constexpr int MR = kVec >= 16 ? 8 : 4;           // a tile's rows: MR x 3 sums fill most of the registers
constexpr int64_t kUnroll = 8;                   // inputs a step; each step asks for a few lines ahead
constexpr int64_t kLine = 64;

// The prefetch schedule over one panel's work: `per_step` lines of the next panel at each step.
struct Ahead {
  const char* next = nullptr;  // the next panel, or none
  int64_t lines = 0;           // its cache lines
  int64_t per_step = 0;

  // Where a row block's steps start asking, and past which they stop.
  const char* from(int64_t first_line) const { return next ? next + first_line * kLine : nullptr; }
  const char* end() const { return next ? next + lines * kLine : nullptr; }
};

inline void ask_ahead(const char*& line, const char* last, int64_t per_step) {
  for (int64_t p = 0; p < per_step && line < last; ++p, line += kLine) __builtin_prefetch(line, 0, 2);
}

// c[0:rows, 0:cols] = a[0:rows, :] . panel (+ bias), rows <= MR, float32. With `ahead`, this block's
// steps ask for the next panel's lines from `first_line` on.
template <int ROWS>
struct Float32Tile {
  static void run(const float* a, int64_t lda, const void* panel_bytes, int64_t k, float* c, int64_t ldc,
                  int64_t cols, const float* bias, const Ahead& ahead, int64_t first_line);
};

template <int ROWS>
void Float32Tile<ROWS>::run(const float* a, int64_t lda, const void* panel_bytes, int64_t k, float* c, int64_t ldc,
                            int64_t cols, const float* bias, const Ahead& ahead, int64_t first_line) {
  const float* panel = static_cast<const float*>(panel_bytes);
  Reg sum[ROWS][3];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < 3; ++j) sum[i][j] = broadcast(0.0f);
  const char* line = ahead.from(first_line);
  const char* last = ahead.end();
  int64_t step = 0;
  for (; step + kUnroll <= k; step += kUnroll) {
    ask_ahead(line, last, ahead.per_step);
#pragma GCC unroll 8
    for (int64_t u = 0; u < kUnroll; ++u) {
      const float* w = panel + (step + u) * NR;
      const Reg w0 = load(w), w1 = load(w + kVec), w2 = load(w + 2 * kVec);
#pragma GCC unroll 8
      for (int i = 0; i < ROWS; ++i) {
        const Reg x = broadcast(a[i * lda + step + u]);
        sum[i][0] = fmadd(x, w0, sum[i][0]);
        sum[i][1] = fmadd(x, w1, sum[i][1]);
        sum[i][2] = fmadd(x, w2, sum[i][2]);
      }
    }
  }
  for (; step < k; ++step) {
    const float* w = panel + step * NR;
    const Reg w0 = load(w), w1 = load(w + kVec), w2 = load(w + 2 * kVec);
    for (int i = 0; i < ROWS; ++i) {
      const Reg x = broadcast(a[i * lda + step]);
      sum[i][0] = fmadd(x, w0, sum[i][0]);
      sum[i][1] = fmadd(x, w1, sum[i][1]);
      sum[i][2] = fmadd(x, w2, sum[i][2]);
    }
  }
  std::array<float, NR> b{};
  if (bias != nullptr) std::copy(bias, bias + cols, b.begin());
  for (int i = 0; i < ROWS; ++i) {
    float* row = c + i * ldc;
    for (int j = 0; j < 3; ++j) {
      const Vec out = Vec(sum[i][j]) + Vec::loadu(b.data() + j * kVec);
      const int64_t left = cols - j * kVec;
      if (left >= kVec) out.store(row + j * kVec);
      else if (left > 0) out.store(row + j * kVec, left);
    }
  }
}

template <typename In, typename Out>
using Tile = void (*)(const In*, int64_t, const void*, int64_t, Out*, int64_t, int64_t, const Out*, const Ahead&,
                      int64_t);

// The tiles of 1 to MR rows, by their row count.
template <typename In, typename Out, template <int> class Of, int... R>
constexpr std::array<Tile<In, Out>, MR + 1> tiles(std::integer_sequence<int, R...>) {
  return {nullptr, &Of<R + 1>::run...};
}

// a (m, steps) in its row blocks times each of `count` panels of `steps` steps, `step_bytes` each, into
// c (m, n): threads share the panels, and each asks for its next panel while it works on one.
template <typename In, typename Out>
void over_panels(const std::array<Tile<In, Out>, MR + 1>& by_rows, const In* a, int64_t m, const char* panels,
                 int64_t count, int64_t steps, int64_t step_bytes, Out* c, int64_t n, const Out* bias) {
  const int64_t blocks = (m + MR - 1) / MR;
  const int64_t panel_bytes = steps * step_bytes;
  const int64_t lines = panel_bytes / kLine;
  const int64_t asks = std::max<int64_t>(1, steps / kUnroll);  // steps of a row block that ask ahead
  const int64_t per_step = (lines + blocks * asks - 1) / (blocks * asks);
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const char* panel = panels + p * panel_bytes;
      const Ahead ahead{p + 1 < end ? panel + panel_bytes : nullptr, lines, per_step};
      const int64_t cols = std::min(NR, n - p * NR);
      for (int64_t r = 0; r < blocks; ++r) {
        const int64_t rows = std::min<int64_t>(MR, m - r * MR);
        by_rows[rows](a + r * MR * steps, steps, panel, steps, c + r * MR * n + p * NR, n, cols,
                      bias ? bias + p * NR : nullptr, ahead, r * asks * per_step);
      }
    }
  });
}

#if defined(CPU_CAPABILITY_AVX512)
// A bfloat16 tile: each step a pair of inputs, (a's two values as one 32-bit word) . (the panel's
// 2 x NR values there), by vdpbf16ps; AVX-512's build alone has it, and only CPUs with AVX512_BF16 run it.
template <int ROWS>
struct BFloat16Tile {
  static constexpr int64_t kPair = 2 * kVec;  // bfloat16 values in a register: 16 columns' pairs

  // One step: every row's pair of inputs `s` times the panel's three registers there, `w`.
  __attribute__((target("avx512bf16"), always_inline)) static inline void pair(
      __m512 (&sum)[ROWS][3], const uint32_t* a, int64_t lda, const uint16_t* w, int64_t s) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + kPair),
                   w2 = (__m512bh)_mm512_loadu_si512(w + 2 * kPair);
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * lda + s]));
      sum[i][0] = _mm512_dpbf16_ps(sum[i][0], x, w0);
      sum[i][1] = _mm512_dpbf16_ps(sum[i][1], x, w1);
      sum[i][2] = _mm512_dpbf16_ps(sum[i][2], x, w2);
    }
  }

  __attribute__((target("avx512bf16"))) static void run(
      const uint32_t* a, int64_t lda, const void* panel_bytes, int64_t k2, at::BFloat16* c, int64_t ldc,
      int64_t cols, const at::BFloat16* bias, const Ahead& ahead, int64_t first_line) {
    const uint16_t* panel = static_cast<const uint16_t*>(panel_bytes);
    __m512 sum[ROWS][3];
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < 3; ++j) sum[i][j] = _mm512_setzero_ps();
    const char* line = ahead.from(first_line);
    const char* last = ahead.end();
    int64_t step = 0;
    for (; step + kUnroll <= k2; step += kUnroll) {
      ask_ahead(line, last, ahead.per_step);
#pragma GCC unroll 8
      for (int64_t u = 0; u < kUnroll; ++u) pair(sum, a, lda, panel + (step + u) * 2 * NR, step + u);
    }
    for (; step < k2; ++step) pair(sum, a, lda, panel + step * 2 * NR, step);
    std::array<float, NR> b{};
    if (bias != nullptr)
      for (int64_t j = 0; j < cols; ++j) b[j] = static_cast<float>(bias[j]);
    for (int i = 0; i < ROWS; ++i) {
      for (int j = 0; j < 3; ++j) {
        const int64_t left = std::min<int64_t>(kVec, cols - j * kVec);
        if (left <= 0) break;
        const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(sum[i][j], _mm512_loadu_ps(b.data() + j * kVec)));
        const __mmask16 keep = left == kVec ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
        _mm256_mask_storeu_epi16(c + i * ldc + j * kVec, keep, (__m256i)out);
      }
    }
  }
};

bool bfloat16_products() { return __builtin_cpu_supports("avx512bf16"); }
#else
bool bfloat16_products() { return false; }
#endif

// (N, K) float32 -> (ceil(N / NR), K, NR); bfloat16 -> (ceil(N / NR), ceil(K / 2), 2 NR), each step a
// pair of inputs, column by column. The last panel's missing columns, and an odd K's last pair's
// second input, are zero.
at::Tensor pack_panels(const at::Tensor& weight) {
  const bool half = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || half) && weight.device().is_cpu(),
              "weight: a (N, K) float32 or bfloat16 CPU tensor");
  TORCH_CHECK(weight.size(0) > 0 && weight.size(1) > 0, "weight: at least one row and one input");
  TORCH_CHECK(!half || bfloat16_products(), "bfloat16 panels need AVX512_BF16, which this CPU lacks");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + NR - 1) / NR;
  const int64_t width = half ? 2 : 1, steps = (k + width - 1) / width;
  at::Tensor padded = at::zeros({panels * NR, steps * width}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  return padded.view({panels, NR, steps, width}).permute({0, 2, 1, 3}).contiguous().view({panels, steps, NR * width});
}

// x (..., K) times the weight packed by pack_panels from (N, K), plus bias (N) if given -> (..., N), in
// the panels' dtype.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                        const std::optional<at::Tensor>& bias) {
  const auto dtype = panels.scalar_type();
  const bool half = dtype == at::kBFloat16;
  const int64_t width = half ? 2 : 1;
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR * width && panels.is_contiguous() &&
                  (dtype == at::kFloat || (half && bfloat16_products())),
              "panels: (P, K, ", NR, ") float32 or (P, ceil(K / 2), ", 2 * NR,
              ") bfloat16 where the CPU has it, contiguous, from pack_panels");
  TORCH_CHECK(x.scalar_type() == dtype && x.device().is_cpu(), "x: a CPU tensor of the panels' dtype");
  const int64_t steps = panels.size(1), count = panels.size(0), k = x.size(-1);
  TORCH_CHECK(steps > 0 && count > 0, "panels: at least one panel of one input");
  TORCH_CHECK((k + width - 1) / width == steps, "x: ", steps * width, half ? " or one fewer" : "", " inputs a row");
  TORCH_CHECK(n > (count - 1) * NR && n <= count * NR, "n: ", n, " does not fit ", count, " panels");
  TORCH_CHECK(!bias || (bias->scalar_type() == dtype && bias->numel() == n && bias->is_contiguous()),
              "bias: ", n, " contiguous values of the panels' dtype");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  at::Tensor a = x.reshape({-1, k}).contiguous();
  const int64_t m = a.size(0);
  if (m == 0) return out;
  if (k < steps * width) a = at::constant_pad_nd(a, {0, steps * width - k});  // an odd K's last pair
  const char* w = static_cast<const char*>(panels.data_ptr());
  const int64_t step_bytes = NR * width * panels.element_size();
#if defined(CPU_CAPABILITY_AVX512)
  if (half) {
    static constexpr auto by_rows =
        tiles<uint32_t, at::BFloat16, BFloat16Tile>(std::make_integer_sequence<int, MR>{});
    over_panels(by_rows, static_cast<const uint32_t*>(a.data_ptr()), m, w, count, steps, step_bytes,
                out.data_ptr<at::BFloat16>(), n, bias ? bias->data_ptr<at::BFloat16>() : nullptr);
    return out;
  }
#endif
  static constexpr auto by_rows = tiles<float, float, Float32Tile>(std::make_integer_sequence<int, MR>{});
  over_panels(by_rows, a.data_ptr<float>(), m, w, count, steps, step_bytes, out.data_ptr<float>(), n,
              bias ? bias->data_ptr<float>() : nullptr);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(drivetrain, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias=None) -> Tensor");
  m.def("panels_take_bfloat16() -> bool", bfloat16_products);
}

TORCH_LIBRARY_IMPL(drivetrain, CPU, m) {
  m.impl("pack_panels", pack_panels);
  m.impl("panel_linear", panel_linear);
}

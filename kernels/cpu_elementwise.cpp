// The small float32 operations between a layer's products, each in one pass over its rows, on the CPU.
//
// Left to PyTorch in an eager step, SwiGLU's gate is three kernels and a temporary, the residual add
// and RMSNorm after it nine, rotary embedding nine for each of q and k: each one a parallel region of
// its own over a prompt chunk's rows, reading and writing them from memory, the second core waiting
// at every one's end. Here each is one region over rows, a row's work in registers, with the same
// arithmetic as the references in silu_mul.py, rms_norm.py and rope.py. Graphs never call these:
// inductor fuses the references' operations itself.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t kGrainElements = 16384;  // a thread's least share: below it, threads cost more than they save

// Rows a thread takes at a time, so that each share holds about kGrainElements.
inline int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": (T, C) with each row contiguous");
}

// silu(gate) * up over (T, 2I) -> (T, I): silu as PyTorch's, x / (1 + e^-x), then the product.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: an even number of columns");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(2 * inter), [&](int64_t begin, int64_t end) {
    const Vec one(1.0f);
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * stride;
      const float* up = gate + inter;
      float* dst = o + r * inter;
      int64_t j = 0;
      for (; j + W <= inter; j += W) {
        const Vec g = Vec::loadu(gate + j);
        (g / (one + g.neg().exp()) * Vec::loadu(up + j)).store(dst + j);
      }
      if (j < inter) {
        const int64_t rest = inter - j;
        const Vec g = Vec::loadu(gate + j, rest);
        (g / (one + g.neg().exp()) * Vec::loadu(up + j, rest)).store(dst + j, rest);
      }
    }
  });
  return out;
}

// (x + delta, weight * RMSNorm(x + delta)); without delta, (x, weight * RMSNorm(x)).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& delta,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == cols && weight.is_contiguous(),
              "weight: contiguous float32 (C,)");
  if (delta.has_value()) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), "delta: x's shape");
  }
  at::Tensor sum = delta.has_value() ? at::empty({rows, cols}, x.options()) : x;
  at::Tensor out = at::empty({rows, cols}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* dp = delta.has_value() ? delta->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), ds = delta.has_value() ? delta->stride(0) : 0, ss = sum.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * xs;
      if (dp != nullptr) {
        float* s = sp + r * ss;
        at::vec::map2([](Vec a, Vec b) { return a + b; }, s, row, dp + r * ds, cols);
        row = s;
      }
      const float mean_square =
          at::vec::map_reduce_all([](Vec v) { return v * v; }, [](Vec a, Vec b) { return a + b; }, row, cols) / cols;
      const Vec inverse(1.0f / std::sqrt(mean_square + e));
      at::vec::map2([&](Vec v, Vec w) { return w * (v * inverse); }, op + r * cols, row, wp, cols);
    }
  });
  return {sum, out};
}

// Each head of x (T, H, D) rotated by its token's angles, cos and sin (T, 1, D/2), rotate-half layout:
// [x1 cos - x2 sin, x2 cos + x1 sin].
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 &&
                  x.size(2) % 2 == 0 && x.stride(1) == x.size(2),
              "x: float32 (T, H, D), D even, each token's heads contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == tokens && t->size(1) == 1 &&
                    t->size(2) == half && t->stride(2) == 1,
                "cos, sin: float32 (T, 1, D/2), each row contiguous");
  at::Tensor out = at::empty({tokens, heads, 2 * half}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), cs = cos.stride(0), sns = sin.stride(0);
  at::parallel_for(0, tokens, grain_rows(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * cs;
      const float* s = snp + t * sns;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x1 = xp + t * xs + h * 2 * half;
        const float* x2 = x1 + half;
        float* o1 = op + (t * heads + h) * 2 * half;
        float* o2 = o1 + half;
        int64_t j = 0;
        for (; j + W <= half; j += W) {
          const Vec a = Vec::loadu(x1 + j), b = Vec::loadu(x2 + j), cv = Vec::loadu(c + j), sv = Vec::loadu(s + j);
          (a * cv - b * sv).store(o1 + j);
          (b * cv + a * sv).store(o2 + j);
        }
        for (; j < half; ++j) {
          const float a = x1[j], b = x2[j];
          o1[j] = a * c[j] - b * s[j];
          o2[j] = b * c[j] + a * s[j];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(drivetrain, m) {
  m.def("cpu_silu_mul(Tensor gate_up) -> Tensor");
  m.def("cpu_add_rms_norm(Tensor x, Tensor? delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("cpu_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(drivetrain, CPU, m) {
  m.impl("cpu_silu_mul", silu_mul);
  m.impl("cpu_add_rms_norm", add_rms_norm);
  m.impl("cpu_rope", rope);
}

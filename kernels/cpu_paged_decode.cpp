// Decode attention on the CPU over the paged KV cache: one new query token per sequence, each reading
// its cached keys and values where they lie, one slot row at a time.
//
// Bound by memory: a step's sequences read every layer's cache once, far more than fits in any cache,
// so the loops are shaped for the reads. Each task takes one sequence's KV heads (over a part of its
// positions, where the sequence holds much of the step's work), reads each slot's row of them once, in
// order, and asks for the rows a few positions ahead (keys and values both) while it multiplies the
// current one: the slots of a sequence lie in blocks scattered through the cache, where the hardware's
// own prefetching loses the thread at every block's end. Scores go to a scratch row per query head, then
// a softmax over each, then the values' weighted sum; a sequence's parts are merged at the end. Threads
// take runs of tasks of about equal work.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

constexpr int64_t kPrefetchRows = 8;  // slot rows asked for ahead of the one being read
constexpr int kHeadsAtOnce = 4;       // query heads whose weighted sums of values are held in registers
constexpr int64_t kCacheLine = 64;
// Vector registers to hold sums in: AVX-512's 32, else AVX2's 16 (NEON's 32 counted as 16, to be safe).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif

inline Vec load(const float* p) { return Vec::loadu(p); }

// A bfloat16 or float16 cache, converted as it is loaded. Plain overloads, not one template: the
// arguments' namespace (c10) has a `load` template of its own, which would make the call ambiguous.
inline Vec load(const at::BFloat16* p) {
  Vec out;
  at::vec::load_to_float(p, out);
  return out;
}

inline Vec load(const at::Half* p) {
  Vec out;
  at::vec::load_to_float(p, out);
  return out;
}

inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// Into the level-2 cache (prefetcht1), not the first: a core has a few dozen misses to the first level in
// flight at most, and a row's keys and values asked for there filled them, where the second level takes
// more at once. SmolLM2's heads over 30 layers' caches in turn (loadtest/bench_cpu_attention_memory.py,
// 2-core Zen 4 EPYC): float32 read at 0.72-0.77 of a plain read's rate where it read at 0.31-0.52
// (64 sequences at contexts of 112: 13.9 against 19.7 ms), float16 at 0.51-0.67 against 0.38-0.51.
// The empty asm keeps the loop: GCC may delete a loop whose only effect is prefetching (it did,
// once this was inlined into a helper), and the kernel would then read at two thirds of its speed.
template <typename kv_t>
inline void prefetch_row(const kv_t* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < bytes; offset += kCacheLine) {
    __builtin_prefetch(p + offset, 0, 2);
    asm volatile("" : : "r"(p + offset));
  }
}

// Softmax of each of `heads` rows of `len` scores, in place, given each row's largest score; returns each
// row's 1 / sum of exponentials (the weighted sums are divided once, at the end).
inline void exponentiate(float* scores, int64_t heads, int64_t len, const float* tops, float* inverse_sums) {
  constexpr int64_t W = Vec::size();
  for (int64_t j = 0; j < heads; ++j) {
    float* row = scores + j * len;
    Vec top(tops[j]), sum(0.f);
    int64_t s = 0;
    for (; s + W <= len; s += W) {
      Vec e = (Vec::loadu(row + s) - top).exp();
      e.store(row + s);
      sum = sum + e;
    }
    if (s < len) {  // the lanes past the row load as zeros: exp(0 - top) each, taken back out of the sum
      const int64_t rest = len - s;
      Vec e = (Vec::loadu(row + s, rest) - top).exp();
      e.store(row + s, rest);
      sum = sum + Vec::set(Vec(0.f), e, rest);
    }
    inverse_sums[j] = 1.f / sum_lanes(sum);
  }
}

// The values' weighted sums of G query heads that share a KV head, over `len` positions, each times its
// head's 1 / sum of exponentials: `weights` holds each head's row of `len`, a slot's values for the KV
// head lie `head_offset` floats into its row. The G heads' sums stay in registers, a few vectors of the
// head dimension at a time beside each head's weight and the values' vector; over a run-time count of
// heads, AVX2's 16 registers could not hold them and every product's sum went through memory (SmolLM2's
// heads, Zen 3, both built side by side: 0.82-0.87 of the time from the third-level cache, over 30
// layers' caches from memory 0.94-0.95 float32 and 0.78 float16; docs/cpu-performance.md).
template <typename kv_t, int D, int G>
void weigh_values(const float* weights, int64_t len, const kv_t* v_cache, const int64_t* slots, int64_t row,
                  int64_t head_offset, const float* inverse_sums, float* out) {
  constexpr int W = Vec::size(), C = D / W;
  constexpr int fit = (kVectorRegisters - 1 - G) / G;  // vectors of sums a head, beside its weight and a value
  constexpr int CC = static_cast<int>(std::bit_floor(static_cast<unsigned>(std::min(fit, C))));  // C's a power of 2
  static_assert(CC >= 1 && C % CC == 0, "whole runs of vectors");
  for (int c0 = 0; c0 < C; c0 += CC) {
    Vec acc[G][CC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CC; ++c) acc[g][c] = Vec(0.f);
    for (int64_t s = 0; s < len; ++s) {
      const kv_t* values = v_cache + slots[s] * row + head_offset + c0 * W;
      Vec weight[G];
      for (int g = 0; g < G; ++g) weight[g] = Vec(weights[g * len + s]);
      for (int c = 0; c < CC; ++c) {
        const Vec v = load(values + c * W);
        for (int g = 0; g < G; ++g) acc[g][c] = at::vec::fmadd(weight[g], v, acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const Vec inverse(inverse_sums[g]);
      for (int c = 0; c < CC; ++c) (acc[g][c] * inverse).store(out + g * D + (c0 + c) * W);
    }
  }
}

// Every KV head of one sequence over `len` of its positions, whose flat slots are `slots`: q holds the
// sequence's Hq * D floats, out receives as many. Where those are some of the sequence's positions only,
// `part` receives each query head's largest score, then each one's sum of exponentials, for merge_parts.
template <typename kv_t, int D>
void attend(const float* q, float* out, const kv_t* k_cache, const kv_t* v_cache, const int64_t* slots, int64_t len,
            int64_t num_kv_heads, int64_t group, float scale, std::vector<float>& scratch, float* part) {
  constexpr int W = Vec::size();
  static_assert(D % W == 0, "head_dim: whole vectors");
  constexpr int C = D / W;
  const int64_t row = num_kv_heads * D;  // one slot's keys (or values), every KV head
  const int64_t heads = num_kv_heads * group;
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(kv_t));
  scratch.resize(heads * len + 2 * heads);
  float* scores = scratch.data();
  float* tops = scores + heads * len;
  float* inverse_sums = tops + heads;
  std::fill(tops, tops + heads, -std::numeric_limits<float>::infinity());

  for (int64_t s = 0; s < len; ++s) {
    if (s + kPrefetchRows < len) {
      const int64_t ahead = slots[s + kPrefetchRows] * row;
      prefetch_row(k_cache + ahead, row_bytes);
      prefetch_row(v_cache + ahead, row_bytes);
    }
    const kv_t* keys = k_cache + slots[s] * row;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      Vec k[C];
      for (int c = 0; c < C; ++c) k[c] = load(keys + h * D + c * W);
      for (int64_t g = 0; g < group; ++g) {
        const float* qh = q + (h * group + g) * D;
        Vec acc = Vec::loadu(qh) * k[0];
        for (int c = 1; c < C; ++c) acc = at::vec::fmadd(Vec::loadu(qh + c * W), k[c], acc);
        const int64_t j = h * group + g;
        scores[j * len + s] = sum_lanes(acc) * scale;
        tops[j] = std::max(tops[j], scores[j * len + s]);
      }
    }
  }

  exponentiate(scores, heads, len, tops, inverse_sums);
  if (part) {
    std::copy(tops, tops + heads, part);
    for (int64_t j = 0; j < heads; ++j) part[heads + j] = 1.f / inverse_sums[j];
  }

  for (int64_t h = 0; h < num_kv_heads; ++h) {
    for (int64_t g0 = 0; g0 < group; g0 += kHeadsAtOnce) {
      const int64_t j = h * group + g0;
      const auto weigh = [&](auto heads) {  // G: a compile-time count, so the sums can stay in registers
        constexpr int G = decltype(heads)::value;
        weigh_values<kv_t, D, G>(scores + j * len, len, v_cache, slots, row, h * D, inverse_sums + j, out + j * D);
      };
      switch (std::min<int64_t>(kHeadsAtOnce, group - g0)) {
        case 1: weigh(std::integral_constant<int, 1>()); break;
        case 2: weigh(std::integral_constant<int, 2>()); break;
        case 3: weigh(std::integral_constant<int, 3>()); break;
        default: weigh(std::integral_constant<int, 4>());
      }
    }
  }
}

// A task: one sequence's positions [s0, s1), part `part` of the `parts` that cut them.
struct Task {
  int64_t sequence, s0, s1, part, parts;
};

// A sequence holding more than a quarter of a thread's share of all positions is cut into parts of about
// kPartRows positions, at most kMaxParts, and into as many as a thread each where the sequences alone would
// not share the threads out (a part holds a position at least): a few sequences, or one long one among
// short ones, still keep every thread busy, where one long sequence whole left one thread working on it
// while the other waited (8 sequences, one of 2,000 among 100s: 1.29x the time of 8 even ones, 30
// layers' caches in turn). A part takes every KV head, its rows read whole: cut by KV head as well (a
// thread reading a third of each row; SmolLM2's heads, Zen 4), one context of 4,000 took 1.1-1.15x the
// time, 4 of 2,000 1.15-1.2x, one of 300 1.25x (paired medians of 11-15 rounds taking turns).
constexpr int64_t kPartRows = 128;
constexpr int64_t kMaxParts = 32;

inline std::vector<Task> plan_tasks(const int64_t* lengths, int64_t n, int64_t threads) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += lengths[i];
  const int64_t longest_whole = total / (4 * threads);
  const int64_t fewest = (threads + n - 1) / n;
  std::vector<Task> tasks;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = lengths[i];
    const int64_t parts = len <= longest_whole
                              ? 1
                              : std::clamp<int64_t>(len / kPartRows, std::min({fewest, len, kMaxParts}), kMaxParts);
    for (int64_t p = 0; p < parts; ++p) tasks.push_back({i, len * p / parts, len * (p + 1) / parts, p, parts});
  }
  return tasks;
}

// Each task's work is its positions, plus a few rows' worth for what every task costs at any length.
// Threads take contiguous runs of tasks of about equal work, not of equal count: halves by count left one
// thread waiting out the other whenever a long context fell in its half.
constexpr int64_t kTaskRows = 8;

// Where the middle of each task's work lies along the run of all tasks, doubled (to stay whole), then the
// whole run's work doubled.
inline std::vector<int64_t> task_midpoints(const std::vector<Task>& tasks) {
  std::vector<int64_t> midpoints(tasks.size() + 1);
  int64_t before = 0;
  for (size_t t = 0; t < tasks.size(); ++t) {
    const int64_t work = tasks[t].s1 - tasks[t].s0 + kTaskRows;
    midpoints[t] = 2 * before + work;
    before += work;
  }
  midpoints.back() = 2 * before;
  return midpoints;
}

// The first task of share s of `shares`: a task belongs to the share its work's middle falls in, so
// shares 0..shares take every task exactly once, in order.
inline int64_t first_task_of(const std::vector<int64_t>& midpoints, int64_t s, int64_t shares) {
  const int64_t bound = midpoints.back() * s / shares;
  return std::lower_bound(midpoints.begin(), midpoints.end() - 1, bound) - midpoints.begin();
}

// One query head's output from its parts' outputs: each part's output is its values' weighted sum over
// its own sum of exponentials, so weigh each by that sum times e^(its top - the top of all parts). Part p's
// top, sum and output each lie `stride` floats after part p - 1's.
template <int D>
void merge_parts(const float* tops, const float* sums, const float* outs, int64_t parts, int64_t stride,
                 float* out) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < parts; ++p) top = std::max(top, tops[p * stride]);
  float total = 0.f;
  float merged[D] = {};
  for (int64_t p = 0; p < parts; ++p) {
    const float weight = sums[p * stride] * std::exp(tops[p * stride] - top);
    total += weight;
    for (int d = 0; d < D; ++d) merged[d] += weight * outs[p * stride + d];
  }
  for (int d = 0; d < D; ++d) out[d] = merged[d] / total;
}

template <typename kv_t, int D>
void attend_all(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& read_slots, const at::Tensor& lengths, float scale) {
  const int64_t n = q.size(0), num_q_heads = q.size(1);
  const int64_t num_kv_heads = k_cache.size(2), width = read_slots.size(1);
  const int64_t group = num_q_heads / num_kv_heads;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const kv_t* kp = k_cache.data_ptr<kv_t>();
  const kv_t* vp = v_cache.data_ptr<kv_t>();
  const int64_t* sp = read_slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const std::vector<Task> tasks = plan_tasks(lp, n, at::get_num_threads());
  const std::vector<int64_t> midpoints = task_midpoints(tasks);
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  // Where a sequence's positions were cut: per task, per query head, its top and sum, then its output over
  // the task's own positions.
  const int64_t stats_floats = 2 * num_q_heads, part_floats = num_q_heads * (D + 2);
  const bool cut = std::any_of(tasks.begin(), tasks.end(), [](const Task& t) { return t.parts > 1; });
  std::vector<float> parts(cut ? num_tasks * part_floats : 0);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, threads, 1, [&](int64_t first_share, int64_t last_share) {
    std::vector<float> scratch;
    const int64_t end = first_task_of(midpoints, last_share, threads);
    for (int64_t t = first_task_of(midpoints, first_share, threads); t < end; ++t) {
      const Task& task = tasks[t];
      const int64_t offset = task.sequence * num_q_heads * D;
      float* part = task.parts > 1 ? parts.data() + t * part_floats : nullptr;
      float* dest = part ? part + stats_floats : op + offset;
      attend<kv_t, D>(qp + offset, dest, kp, vp, sp + task.sequence * width + task.s0, task.s1 - task.s0,
                      num_kv_heads, group, scale, scratch, part);
    }
  });
  for (int64_t t = 0; t < num_tasks; ++t) {
    const Task& task = tasks[t];
    if (task.parts == 1 || task.part != 0) continue;
    const float* block = parts.data() + t * part_floats;
    for (int64_t j = 0; j < num_q_heads; ++j)
      merge_parts<D>(block + j, block + num_q_heads + j, block + stats_floats + j * D, task.parts, part_floats,
                     op + (task.sequence * num_q_heads + j) * D);
  }
}

template <typename kv_t>
void dispatch_head_dim(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& read_slots, const at::Tensor& lengths, float scale) {
  switch (q.size(2)) {
    case 16: return attend_all<kv_t, 16>(q, out, k_cache, v_cache, read_slots, lengths, scale);
    case 32: return attend_all<kv_t, 32>(q, out, k_cache, v_cache, read_slots, lengths, scale);
    case 64: return attend_all<kv_t, 64>(q, out, k_cache, v_cache, read_slots, lengths, scale);
    case 128: return attend_all<kv_t, 128>(q, out, k_cache, v_cache, read_slots, lengths, scale);
    case 256: return attend_all<kv_t, 256>(q, out, k_cache, v_cache, read_slots, lengths, scale);
    default: TORCH_CHECK(false, "paged_decode_attention: head_dim 16, 32, 64, 128 or 256, got ", q.size(2));
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& read_slots, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous (n, Hq, D) float32");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches: contiguous (num_blocks, block_size, Hkv, D), alike");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "caches do not match q's heads");
  TORCH_CHECK(read_slots.dim() == 2 && read_slots.size(0) == q.size(0) && read_slots.scalar_type() == at::kLong &&
                  read_slots.is_contiguous(), "read_slots: contiguous (n, S) int64");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == q.size(0) && lengths.scalar_type() == at::kLong &&
                  lengths.is_contiguous(), "lengths: contiguous (n,) int64");
  const int64_t width = read_slots.size(1);
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < lengths.size(0); ++i)
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= width, "lengths: each within 1..S, got ", lp[i]);
  at::Tensor out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  switch (k_cache.scalar_type()) {
    case at::kFloat: dispatch_head_dim<float>(q, out, k_cache, v_cache, read_slots, lengths, s); break;
    case at::kBFloat16: dispatch_head_dim<at::BFloat16>(q, out, k_cache, v_cache, read_slots, lengths, s); break;
    case at::kHalf: dispatch_head_dim<at::Half>(q, out, k_cache, v_cache, read_slots, lengths, s); break;
    default:
      TORCH_CHECK(false, "paged_decode_attention: a float32, bfloat16 or float16 cache, got ", k_cache.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(drivetrain, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor read_slots, Tensor lengths, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(drivetrain, CPU, m) { m.impl("paged_decode_attention", paged_decode_attention); }

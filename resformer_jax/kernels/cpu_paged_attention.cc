// Decode attention over a paged KV cache on a CPU, as an XLA FFI custom call (kernels/cpu_paged_attention.py
// builds and loads it). One new token a row attends over the first lengths[b] tokens of its pages:
//   out[b, h] = softmax(q[b, h] . K[b, :len]) V[b, :len]        (q already scaled by 1 / sqrt(D))
// Pools are pages-major [pages, page_size, K * D] (fp32, or bf16 or its bits as uint16; a page's tokens, each
// token's heads together), the page table [B, P], lengths [B]; query head h reads kv head h / (H / K) (GQA). A
// row (or a share of its heads, when rows are fewer than threads) is one work item: its pages are read where they
// lie, K once (every query head scores a token while it is in L1), then V once, so each cached byte crosses
// memory once, a page at a time in one stream (heads-major pages were 4 KiB apart at head_dim 64, and this CPU
// reads scattered 4 KiB pieces at half the speed of 16 KiB ones). Items are spread over XLA's intra-op threads;
// the caller takes some.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Eight floats a vector (GCC's vector extensions: AVX2 or AVX-512 registers, or NEON's pairs, whichever -march has).
typedef float F8 __attribute__((vector_size(32)));
typedef uint32_t U8 __attribute__((vector_size(32)));
typedef uint16_t H8 __attribute__((vector_size(16)));

inline F8 Load8(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline F8 Load8(const uint16_t* p) {  // bf16: the top half of an fp32
  H8 h;
  std::memcpy(&h, p, sizeof h);
  const U8 u = __builtin_convertvector(h, U8) << 16;
  F8 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline float Sum8(F8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// q . k over D (a multiple of 8), two accumulators so two FMA chains run at once.
template <typename T>
inline float Dot(const float* q, const T* k, int64_t D) {
  F8 a0 = {}, a1 = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    a0 += Load8(q + d) * Load8(k + d);
    a1 += Load8(q + d + 8) * Load8(k + d + 8);
  }
  if (d < D) a0 += Load8(q + d) * Load8(k + d);
  return Sum8(a0 + a1);
}

// e^x for x <= 0 (a score minus its row's max): x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial (relative error < 2e-7), 2^n from the exponent bits. Plain arithmetic, so the loop vectorizes.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.f);
  const float n = static_cast<float>(static_cast<int32_t>(x * 1.44269504f - 0.5f));  // round(x / ln2), x <= 0
  const float r = (x - n * 0.693145751953125f) - n * 1.42860677e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

struct Shapes {
  int64_t B, H, D, K, N, page, P;
  int64_t per_item;  // kv heads an item takes
};

// One item: row b's kv heads [k0, k0 + s.per_item) and their query heads (G = H / K each) over the row's first
// `len` tokens. A token's heads lie together in its page ([pages, page_size, K * D]), so K is read as one stream
// a page, then V the same way.
template <typename T>
void AttendItem(const Shapes& s, int64_t b, int64_t k0, const float* q, const T* k_pool, const T* v_pool,
                const int32_t* table, int64_t len, float* out, std::vector<float>& scratch) {
  const int64_t G = s.H / s.K, D = s.D, E = s.K * D, Hs = s.per_item * G;
  float* out_h = out + (b * s.H + k0 * G) * D;
  if (len <= 0) {
    std::fill(out_h, out_h + Hs * D, 0.f);
    return;
  }
  scratch.resize(Hs * len + Hs * D);
  float* scores = scratch.data();  // [Hs, len]
  float* acc = scores + Hs * len;  // [Hs, D]
  const float* q_h = q + (b * s.H + k0 * G) * D;
  const int64_t pages = (len + s.page - 1) / s.page;
  auto token = [&](const T* pool, int64_t p, int64_t t) {  // token t of the row's page p, at head k0
    return pool + (table[b * s.P + p] * s.page + t) * E + k0 * D;
  };
  for (int64_t p = 0; p < pages; ++p) {
    const int64_t n = std::min(s.page, len - p * s.page);
    for (int64_t t = 0; t < n; ++t) {
      const T* kt = token(k_pool, p, t);
      for (int64_t h = 0; h < Hs; ++h) scores[h * len + p * s.page + t] = Dot(q_h + h * D, kt + (h / G) * D, D);
    }
  }
  for (int64_t h = 0; h < Hs; ++h) {
    float* sh = scores + h * len;
    float m = sh[0];
    for (int64_t i = 1; i < len; ++i) m = std::max(m, sh[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < len; ++i) {
      sh[i] = ExpNonPositive(sh[i] - m);
      sum += sh[i];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < len; ++i) sh[i] *= inv;
  }
  std::fill(acc, acc + Hs * D, 0.f);
  for (int64_t p = 0; p < pages; ++p) {
    const int64_t n = std::min(s.page, len - p * s.page);
    for (int64_t t = 0; t < n; ++t) {
      const T* vt = token(v_pool, p, t);
      for (int64_t h = 0; h < Hs; ++h) {
        const F8 w = F8{} + scores[h * len + p * s.page + t];
        const T* vh = vt + (h / G) * D;
        float* a = acc + h * D;
        for (int64_t d = 0; d < D; d += 8) {
          F8 ad = Load8(a + d);
          ad += w * Load8(vh + d);
          std::memcpy(a + d, &ad, sizeof ad);
        }
      }
    }
  }
  std::copy(acc, acc + Hs * D, out_h);
}

struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename T>
ffi::Error Attend(ffi::ThreadPool& pool, Shapes s, const float* q, const T* k_pool, const T* v_pool,
                  const int32_t* table, const int32_t* lengths, float* out) {
  for (int64_t b = 0; b < s.B; ++b) {  // the pages a row reads lie in the pool, or it is refused
    const int64_t len = std::min<int64_t>(lengths[b], s.P * s.page);
    for (int64_t p = 0; p * s.page < len; ++p)
      if (table[b * s.P + p] < 0 || table[b * s.P + p] >= s.N)
        return ffi::Error::InvalidArgument("paged decode attention: row " + std::to_string(b) + " reads page " +
                                           std::to_string(table[b * s.P + p]) + " of a pool of " +
                                           std::to_string(s.N));
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // a row's heads together (one stream a page), split only until every thread has two items
  s.per_item = s.K;
  while (s.per_item % 2 == 0 && s.B * (s.K / s.per_item) < 2 * threads) s.per_item /= 2;
  const int64_t splits = s.K / s.per_item, items = s.B * splits;
  auto progress = std::make_shared<Progress>();
  auto work = [=]() {
    std::vector<float> scratch;
    for (int64_t i; (i = progress->next.fetch_add(1)) < items;) {
      const int64_t b = i / splits, k0 = (i % splits) * s.per_item;
      const int64_t len = std::min<int64_t>(lengths[b], s.P * s.page);
      AttendItem(s, b, k0, q, k_pool, v_pool, table, len, out, scratch);
      progress->done.fetch_add(1);
    }
  };
  // a task that starts after every item is taken reads only `progress` (shared) and returns
  const int64_t helpers = std::min<int64_t>(threads - 1, items - 1);  // the caller is the last worker
  for (int64_t t = 0; t < helpers; ++t)
    pool.Schedule([progress, items, work]() {
      if (progress->next.load() < items) work();
    });
  work();
  while (progress->done.load() < items) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                       ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_pool.dimensions(), vd = v_pool.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged decode attention: q [B, H, D], pools [pages, page, K * D], table [B, P]");
  for (int i = 0; i < 3; ++i)
    if (kd[i] != vd[i])
      return ffi::Error::InvalidArgument("paged decode attention: the K and V pools differ in shape");
  const int64_t D = qd[2];
  if (D % 8 != 0 || kd[2] % D != 0 || td[0] != qd[0] || qd[1] % (kd[2] / D) != 0)
    return ffi::Error::InvalidArgument(
        "paged decode attention: head_dim must be a multiple of 8, and q, pools and table agree on B and heads");
  const Shapes s{qd[0], qd[1], D, kd[2] / D, kd[0], kd[1], td[1], 0};
  if (k_pool.element_type() != v_pool.element_type())
    return ffi::Error::InvalidArgument("paged decode attention: the K and V pools differ in dtype");
  switch (k_pool.element_type()) {
    case ffi::F32:
      return Attend(pool, s, q.typed_data(), static_cast<const float*>(k_pool.untyped_data()),
                    static_cast<const float*>(v_pool.untyped_data()), table.typed_data(), lengths.typed_data(),
                    out->typed_data());
    case ffi::BF16:
    case ffi::U16:  // bf16 stored as its bits (kernels/paged_attention.pool_dtype)
      return Attend(pool, s, q.typed_data(), static_cast<const uint16_t*>(k_pool.untyped_data()),
                    static_cast<const uint16_t*>(v_pool.untyped_data()), table.typed_data(), lengths.typed_data(),
                    out->typed_data());
    default:
      return ffi::Error::InvalidArgument("paged decode attention: pools must be float32 or bfloat16 (or its bits, uint16)");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ResformerPagedDecodeAttention, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, H, D], scaled
                                  .Arg<ffi::AnyBuffer>()         // K pool [pages, page, K * D]
                                  .Arg<ffi::AnyBuffer>()         // V pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page table [B, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths [B]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [B, H, D]

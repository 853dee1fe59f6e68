// Decode attention over a paged KV cache on a CPU, as an XLA FFI custom call (kernels/cpu_paged_attention.py
// builds and loads it). One new token a row attends over the first lengths[b] tokens of its pages:
//   out[b, h] = softmax(q[b, h] . K[b, :len]) V[b, :len]        (q already scaled by 1 / sqrt(D))
// Pools are pages-major [pages, page_size, K * D] (fp32, or bf16 or its bits as uint16; a page's tokens, each
// token's heads together), the page table [B, P], lengths [B]; query head h reads kv head h / (H / K) (GQA). A
// row is one work item (rows fewer than twice the threads: runs of its pages, their softmaxes combined after):
// its pages are read where they lie, K once (every query head scores a token while it is in L1), then V once, so
// each cached byte crosses memory once, a page at a time in one stream (heads-major pages were 4 KiB apart at
// head_dim 64, and this CPU reads scattered 4 KiB pieces at half the speed of 16 KiB ones). Items are spread
// over XLA's intra-op threads; the caller takes some.
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

// Asks for a token's bytes before they are read. A page's next tokens the hardware's prefetcher finds by itself;
// the next page lies anywhere in the pool, so each token asks for the same token of the row's next page
// (docs/evaluation.md: what it gains over scattered pages and over pages in order).
inline void Prefetch(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(static_cast<const char*>(p) + i, 0, 3);
}

struct Shapes {
  int64_t B, H, D, K, N, page, P;
  int64_t splits;  // items a row is cut into, by its pages (1 unless rows are fewer than twice the threads)
};

// One item: row b's tokens [t0, t1) (t0 at a page's start), every head, unnormalised: the scores' max m[h], the
// sum of their exponentials l[h], and acc[h] = sum_t e^(s_t - m) V_t. A token's heads lie together in its page
// ([pages, page_size, K * D]), so K is read as one stream a page (every query head scores a token while it is in
// L1), then V the same way.
template <typename T>
void AttendChunk(const Shapes& s, int64_t b, int64_t t0, int64_t t1, const float* q, const T* k_pool,
                 const T* v_pool, const int32_t* table, float* m, float* l, float* acc, std::vector<float>& scratch) {
  const int64_t G = s.H / s.K, D = s.D, E = s.K * D, H = s.H, n = t1 - t0;
  std::fill(acc, acc + H * D, 0.f);
  if (n <= 0) {
    std::fill(m, m + H, -1e30f);
    std::fill(l, l + H, 0.f);
    return;
  }
  scratch.resize(H * n);
  float* scores = scratch.data();  // [H, n]
  const float* q_b = q + b * H * D;
  auto token = [&](const T* pool, int64_t t) {  // the row's token t, all heads
    return pool + (table[b * s.P + t / s.page] * s.page + t % s.page) * E;
  };
  for (int64_t t = t0; t < t1; ++t) {
    const T* kt = token(k_pool, t);
    if (t + s.page < t1) Prefetch(token(k_pool, t + s.page), E * sizeof(T));
    for (int64_t h = 0; h < H; ++h) scores[h * n + (t - t0)] = Dot(q_b + h * D, kt + (h / G) * D, D);
  }
  for (int64_t h = 0; h < H; ++h) {
    float* sh = scores + h * n;
    float mh = sh[0];
    for (int64_t i = 1; i < n; ++i) mh = std::max(mh, sh[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      sh[i] = ExpNonPositive(sh[i] - mh);
      sum += sh[i];
    }
    m[h] = mh;
    l[h] = sum;
  }
  for (int64_t t = t0; t < t1; ++t) {
    const T* vt = token(v_pool, t);
    if (t + s.page < t1) Prefetch(token(v_pool, t + s.page), E * sizeof(T));
    for (int64_t h = 0; h < H; ++h) {
      const F8 w = F8{} + scores[h * n + (t - t0)];
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
  // A row is one item; fewer rows than twice the threads are cut by their pages (whole pages, every head: one
  // stream a page; cutting by heads instead read 512-byte pieces of each token and ran at half the speed).
  s.splits = s.B >= 2 * threads ? 1 : (2 * threads + s.B - 1) / s.B;
  const int64_t items = s.B * s.splits, H = s.H, D = s.D;
  // an item's m [H], l [H] and acc [H, D]; a whole row's (splits 1) are normalised into out by its item
  auto partial = std::make_shared<std::vector<float>>(s.splits > 1 ? items * H * (D + 2) : 0);
  auto progress = std::make_shared<Progress>();
  auto work = [=]() {
    std::vector<float> scratch, own(s.splits > 1 ? 0 : H * (D + 2));
    for (int64_t i; (i = progress->next.fetch_add(1)) < items;) {
      const int64_t b = i / s.splits, c = i % s.splits;
      const int64_t len = std::max<int64_t>(0, std::min<int64_t>(lengths[b], s.P * s.page));
      const int64_t pages = (len + s.page - 1) / s.page, per = (pages + s.splits - 1) / s.splits;
      const int64_t t0 = std::min(len, c * per * s.page), t1 = std::min(len, (c + 1) * per * s.page);
      float* mla = s.splits > 1 ? partial->data() + i * H * (D + 2) : own.data();
      AttendChunk(s, b, t0, t1, q, k_pool, v_pool, table, mla, mla + H, mla + 2 * H, scratch);
      if (s.splits == 1)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d)
            out[(b * H + h) * D + d] = mla[H + h] > 0.f ? mla[2 * H + h * D + d] / mla[H + h] : 0.f;
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
  if (s.splits > 1)  // a row's pieces combined: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        float M = -1e30f, L = 0.f;
        for (int64_t c = 0; c < s.splits; ++c) M = std::max(M, (*partial)[(b * s.splits + c) * H * (D + 2) + h]);
        float* o = out + (b * H + h) * D;
        std::fill(o, o + D, 0.f);
        for (int64_t c = 0; c < s.splits; ++c) {
          const float* mla = partial->data() + (b * s.splits + c) * H * (D + 2);
          if (mla[H + h] <= 0.f) continue;  // an empty piece
          const float w = ExpNonPositive(mla[h] - M);
          L += w * mla[H + h];
          for (int64_t d = 0; d < D; ++d) o[d] += w * mla[2 * H + h * D + d];
        }
        if (L > 0.f)
          for (int64_t d = 0; d < D; ++d) o[d] /= L;
      }
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
  const Shapes s{qd[0], qd[1], D, kd[2] / D, kd[0], kd[1], td[1], 1};
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

// cp_ops LSE merge: n (2..4) partial attention outputs over disjoint key blocks -> attention over all keys.
//
// For query row x (= (b, s, h)) with partials o_i = softmax over key block i only and lse_i = log sum_j exp(s_xj)
// over that block: out = sum_i w_i o_i / sum_i w_i, w_i = exp(lse_i - m), m = max_i lse_i (m := 0 and out := 0 when every
// lse_i is -inf: a row with no keys) -- the merge of ring / flash-decoding (Milakov & Gimelshein 2018), in fp32.
// The same arithmetic as cp_ops/kernels/lse_merge.py's Triton kernel; this one is launched through pybind11 with
// plain integers (a few µs of host time where Triton's launcher costs tens), for cp_ops' eager pipelined AGKV.
//
// Layouts (element strides): partials [B, S, H, D] with strides (so_b, so_s, so_h, 1), all n alike; LSEs fp32
// [B, H, S] with strides (sl_b, sl_h, sl_s), all n alike; out [B, S, H, D] contiguous, the partials' dtype.
// Each thread owns VEC consecutive elements of a row (16-byte loads and stores when VEC > 1); in the common case
// (see lse_merge_vec_kernel) a thread covers its slice of 2 rows with every load issued first.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#ifndef __CUDA_ARCH__  // pybind11 in the host pass only: the device pass compiles the kernels without parsing it
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#else
#pragma nv_diag_suppress 177  // (the device pass sees the host functions, not the binding that uses them)
#endif

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct MergeArgs {
  unsigned long long o[4];
  unsigned long long l[4];
  unsigned long long out;
  long long rows;
  int n, S, H, D;
  long long so_b, so_s, so_h;
  long long sl_b, sl_h, sl_s;
};

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

// VEC elements of T per thread (VEC * sizeof(T) == 16, or VEC == 1); TPR threads per row.
template <typename T, int VEC>
__global__ void __launch_bounds__(256) lse_merge_kernel(const __grid_constant__ MergeArgs a, int tpr) {
  const int rpb = blockDim.x / tpr;
  const long long row = (long long)blockIdx.x * rpb + threadIdx.x / tpr;
  if (row >= a.rows) return;
  const int lane = threadIdx.x % tpr;
  const long long h = row % a.H;
  const long long s = (row / a.H) % a.S;
  const long long b = row / ((long long)a.H * a.S);
  const long long loff = b * a.sl_b + h * a.sl_h + s * a.sl_s;
  float w[4];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = i < a.n ? reinterpret_cast<const float*>(a.l[i])[loff] : -INFINITY;
    m = fmaxf(m, w[i]);
  }
  if (m == -INFINITY) m = 0.f;
  float den = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = i < a.n ? expf(w[i] - m) : 0.f;
    den += w[i];
  }
  const float inv = den > 0.f ? 1.f / den : 0.f;  // every lse_i -inf: no key anywhere, out = 0
  const long long ooff = b * a.so_b + s * a.so_s + h * a.so_h;
  T* out = reinterpret_cast<T*>(a.out) + row * a.D;
  for (int d0 = lane * VEC; d0 < a.D; d0 += tpr * VEC) {
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (i >= a.n) break;
      const T* src = reinterpret_cast<const T*>(a.o[i]) + ooff + d0;
      T x[VEC];
      if constexpr (VEC > 1) {
        *reinterpret_cast<uint4*>(x) = __ldg(reinterpret_cast<const uint4*>(src));
      } else {
        x[0] = src[0];
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += w[i] * to_f<T>(x[j]);
    }
    T y[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) y[j] = from_f<T>(acc[j] * inv);
    if constexpr (VEC > 1) {
      *reinterpret_cast<uint4*>(out + d0) = *reinterpret_cast<uint4*>(y);
    } else {
      out[d0] = y[0];
    }
  }
}

// The common case (16-byte accesses, one pass over D per thread: D * sizeof(T) <= 32 * 16, e.g. bf16 D <= 256):
// N partials known at compile time and ROWS rows per thread, every load (N partial vectors and N LSEs per row)
// issued before the first use, so a thread waits for one round trip to memory instead of two (the LSEs, then the
// partials) and keeps ROWS * N vectors in flight.
template <typename T, int VEC, int N, int ROWS>
__global__ void __launch_bounds__(256) lse_merge_vec_kernel(const __grid_constant__ MergeArgs a, int tpr) {
  const int rpb = blockDim.x / tpr;
  const int lane = threadIdx.x % tpr;
  const int d0 = lane * VEC;
  long long rows[ROWS];
  uint4 x[ROWS][N];
  float l[ROWS][N];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    rows[r] = ((long long)blockIdx.x * ROWS + r) * rpb + threadIdx.x / tpr;
    const long long row = rows[r] < a.rows ? rows[r] : a.rows - 1;  // a clamped load; its store is skipped
    const long long h = row % a.H;
    const long long s = (row / a.H) % a.S;
    const long long b = row / ((long long)a.H * a.S);
    const long long loff = b * a.sl_b + h * a.sl_h + s * a.sl_s;
    const long long ooff = b * a.so_b + s * a.so_s + h * a.so_h + d0;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      l[r][i] = __ldg(reinterpret_cast<const float*>(a.l[i]) + loff);
      x[r][i] = __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(a.o[i]) + ooff));
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (rows[r] >= a.rows) break;
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < N; ++i) m = fmaxf(m, l[r][i]);
    if (m == -INFINITY) m = 0.f;
    float w[N], den = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      w[i] = expf(l[r][i] - m);
      den += w[i];
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;  // every lse_i -inf: no key anywhere, out = 0
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const T* xv = reinterpret_cast<const T*>(&x[r][i]);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += w[i] * to_f<T>(xv[j]);
    }
    T y[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) y[j] = from_f<T>(acc[j] * inv);
    *reinterpret_cast<uint4*>(reinterpret_cast<T*>(a.out) + rows[r] * a.D + d0) = *reinterpret_cast<uint4*>(y);
  }
}

constexpr int kRows = 2;  // rows per thread of lse_merge_vec_kernel

template <typename T, int N>
void launch_vec(const MergeArgs& a, int tpr, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const long long per_block = (256 / tpr) * (long long)kRows;
  const long long blocks = (a.rows + per_block - 1) / per_block;
  if (blocks > 0x7fffffffLL) throw std::invalid_argument("lse_merge: too many rows for one launch");
  lse_merge_vec_kernel<T, V, N, kRows><<<(unsigned int)blocks, 256, 0, stream>>>(a, tpr);
}

template <typename T>
void launch_typed(const MergeArgs& a, bool vec, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const int per_row = vec ? a.D / V : a.D;
  int tpr = 1;
  while (tpr < per_row && tpr < 32) tpr *= 2;  // a power of two <= 32 dividing the block
  if (vec && tpr * V == a.D && a.n >= 2) {  // one 16-byte vector per thread covers the row: the fast kernel
    if (a.n == 2) launch_vec<T, 2>(a, tpr, stream);
    else if (a.n == 3) launch_vec<T, 3>(a, tpr, stream);
    else launch_vec<T, 4>(a, tpr, stream);
  } else {
    const int rpb = 256 / tpr;
    const long long blocks = (a.rows + rpb - 1) / rpb;
    if (blocks > 0x7fffffffLL) throw std::invalid_argument("lse_merge: too many rows for one launch");
    if (vec) {
      lse_merge_kernel<T, V><<<(unsigned int)blocks, 256, 0, stream>>>(a, tpr);
    } else {
      lse_merge_kernel<T, 1><<<(unsigned int)blocks, 256, 0, stream>>>(a, tpr);
    }
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("lse_merge launch: ") + cudaGetErrorString(err));
}

// dtype: 0 = float32, 1 = bfloat16, 2 = float16. vec: 16-byte accesses (the caller checked D % (16 / size) == 0
// and that every partial's address and row strides, and out's address, are 16-byte aligned).
void lse_merge(uint64_t stream, int device, int dtype, std::vector<uint64_t> outs, std::vector<uint64_t> lses,
               uint64_t out, long long B, int S, int H, int D, long long so_b, long long so_s, long long so_h,
               long long sl_b, long long sl_h, long long sl_s, bool vec) {
  if (outs.size() < 1 || outs.size() > 4 || outs.size() != lses.size())
    throw std::invalid_argument("lse_merge: need 1..4 partials and as many LSEs");
  MergeArgs a{};
  a.n = (int)outs.size();
  for (int i = 0; i < a.n; ++i) {
    a.o[i] = outs[i];
    a.l[i] = lses[i];
  }
  a.out = out;
  a.rows = B * S * H;
  a.S = S;
  a.H = H;
  a.D = D;
  a.so_b = so_b;
  a.so_s = so_s;
  a.so_h = so_h;
  a.sl_b = sl_b;
  a.sl_h = sl_h;
  a.sl_s = sl_s;
  if (a.rows == 0 || D == 0) return;
  int cur = -1;
  cudaGetDevice(&cur);
  if (cur != device) cudaSetDevice(device);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (dtype == 0) launch_typed<float>(a, vec, s);
  else if (dtype == 1) launch_typed<__nv_bfloat16>(a, vec, s);
  else if (dtype == 2) launch_typed<__half>(a, vec, s);
  else throw std::invalid_argument("lse_merge: dtype code must be 0 (fp32), 1 (bf16) or 2 (fp16)");
  if (cur != device && cur >= 0) cudaSetDevice(cur);
}

}  // namespace

#ifndef __CUDA_ARCH__
void register_lse_merge(pybind11::module_& m) {
  m.def("lse_merge", &lse_merge, "LSE merge of 1..4 partial attention outputs (see csrc/lse_merge.cu)");
}
#endif  // __CUDA_ARCH__

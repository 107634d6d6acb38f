// cp_ops fast transport: direct peer writes (copy engine or SM copy kernel) with per-source arrival flags.
//
// One `Lane` per process = one CP group on one node. The lane is given a symmetric heap: a local base
// pointer and, for every group rank, the address of that rank's heap as mapped into this process
// (NVSHMEM nvshmem_ptr, or CUDA IPC). Offsets are symmetric: the buffer at offset `o` on rank p is
// `peer_base[p] + o` here. The heap starts with a control block of uint64 words:
//
//   ready[W]    ready[p]   = last epoch at which rank p allowed us to write into p's buffers
//                            (written by p's begin kernel, i.e. after every earlier op on p's stream)
//   arrived[W]  arrived[p] = last epoch whose data rank p finished writing into our buffers
//   counter     this rank's epoch counter (device-side, so a captured CUDA graph advances it on replay)
//   rec[NREC]   the epoch of each in-flight call slot (kernels of one call read it from here)
//   blocks[n]   per send stream: blocks of the fused SM copy kernel done (the last one signals)
//
// Epochs are uint64 and only grow (one per call): they never wrap. A call (launch):
//   cur stream:   begin kernel: e = ++counter; rec[slot] = e; ready[rank] := e on every peer
//   local stream: copy own chunk into own buffer            -> event src[rank]
//   send streams: per target t: spin until ready[t] >= e; copy (CE memcpy2D or SM kernel) into t's
//                 buffer; arrived[rank] := e on t (release, system scope); the SM path does all three
//                 in one fused kernel launch per target
// `wait(stream, call)` (on the consumer's stream): wait for begin, spin until arrived[p] >= e for every
// peer, join the local and send streams. `wait_source(stream, call, p)` spins on arrived[p] only.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

#define CP_CUDA(expr)                                                                              \
  do {                                                                                             \
    cudaError_t _e = (expr);                                                                       \
    if (_e != cudaSuccess) {                                                                       \
      std::ostringstream _s;                                                                       \
      _s << "cp_ops fast transport: " #expr " failed: " << cudaGetErrorString(_e) << " (" << __FILE__ \
         << ":" << __LINE__ << ")";                                                                \
      throw std::runtime_error(_s.str());                                                          \
    }                                                                                              \
  } while (0)

namespace {

constexpr int kMaxW = 64;
constexpr int kNRec = 64;       // in-flight call slots (events + device epoch records)
constexpr int kMaxDesc = 16;    // copies per SM-kernel launch
constexpr int kThreads = 512;
constexpr int kUnroll = 4;

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

struct PtrList {
  int n;
  unsigned long long p[kMaxW];
};

__global__ void begin_kernel(uint64_t* counter, uint64_t* rec, PtrList peers_ready) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    uint64_t e = *counter + 1;
    *counter = e;
    *rec = e;
    __threadfence_system();
    for (int i = 0; i < peers_ready.n; ++i) st_release_sys(reinterpret_cast<uint64_t*>(peers_ready.p[i]), e);
  }
}

__global__ void wait_kernel(const uint64_t* flag, const uint64_t* rec) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    const uint64_t e = *rec;
    while (ld_acquire_sys(flag) < e) __nanosleep(64);
    __threadfence_system();
  }
}

// Spin until arrived[p] >= *rec for every p != rank (one thread per source).
__global__ void wait_all_kernel(const uint64_t* arrived, int world, int rank, const uint64_t* rec) {
  const uint64_t e = *rec;
  for (int p = threadIdx.x; p < world; p += blockDim.x) {
    if (p == rank) continue;
    while (ld_acquire_sys(arrived + p) < e) __nanosleep(64);
  }
  __syncthreads();
  if (threadIdx.x == 0) __threadfence_system();
}

__global__ void signal_kernel(uint64_t* peer_flag, const uint64_t* rec) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    __threadfence_system();
    st_release_sys(peer_flag, *rec);
  }
}

struct CopyBatch {
  int n;
  unsigned long long dst[kMaxDesc];
  unsigned long long src[kMaxDesc];
  unsigned long long dpitch[kMaxDesc];  // bytes
  unsigned long long spitch[kMaxDesc];  // bytes
  unsigned int vpr[kMaxDesc];           // 16-byte vectors per row
  unsigned long long start[kMaxDesc + 1];  // prefix sums of vectors
};

// 16-byte vector copy of n 2-D regions (rows of vpr*16 bytes, given pitches); kUnroll loads in flight.
// Fused flags (SM path): if wait_flag, every block first spins until *wait_flag >= *rec (the target's
// ready flag); if peer_flag, the last block to finish (counted in *block_count, reset after) stores *rec
// there with release semantics at system scope, after a system fence that covers every block's stores.
__global__ void __launch_bounds__(kThreads) copy2d_kernel(const __grid_constant__ CopyBatch b, const uint64_t* wait_flag,
                                                          const uint64_t* rec, uint64_t* peer_flag,
                                                          unsigned int* block_count) {
  if (wait_flag != nullptr) {
    if (threadIdx.x == 0) {
      const uint64_t e = *rec;
      while (ld_acquire_sys(wait_flag) < e) __nanosleep(64);
    }
    __syncthreads();
  }
  const unsigned long long total = b.start[b.n];
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long base = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; base < total;
       base += stride * kUnroll) {
    int4 v[kUnroll];
    int4* d[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const unsigned long long idx = base + (unsigned long long)u * stride;
      d[u] = nullptr;
      if (idx < total) {
        int k = 0;
        while (idx >= b.start[k + 1]) ++k;
        const unsigned int j = (unsigned int)(idx - b.start[k]);  // < 2^32 vectors (64 GiB) per copy
        const unsigned long long row = j / b.vpr[k];
        const unsigned long long col = j - (unsigned int)row * b.vpr[k];
        const int4* s = reinterpret_cast<const int4*>(b.src[k] + row * b.spitch[k]) + col;
        d[u] = reinterpret_cast<int4*>(b.dst[k] + row * b.dpitch[k]) + col;
        v[u] = __ldg(s);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (d[u]) *d[u] = v[u];
  }
  if (peer_flag != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      const unsigned int prev = atomicAdd(block_count, 1u);
      if (prev == gridDim.x - 1) {
        *block_count = 0;
        __threadfence_system();
        st_release_sys(peer_flag, *rec);
      }
    }
  }
}

// One 2-D copy: dst_off is an offset into the target's heap; src is an absolute device pointer.
struct Desc {
  uint64_t dst_off, src, width, height, dpitch, spitch;
};

// Streams are process-wide per device and never destroyed: torch's caching allocator may still record
// events on them (record_stream on the inputs) after a lane is released.
std::vector<cudaStream_t>& lane_streams(int device, int n) {
  static std::vector<std::vector<cudaStream_t>> per_device(64);
  auto& v = per_device.at(device);
  while ((int)v.size() < n) {
    cudaStream_t s;
    CP_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    v.push_back(s);
  }
  return v;
}

class Lane {
 public:
  Lane(int rank, int world, int device, uint64_t local_base, std::vector<uint64_t> peer_bases, int n_send)
      : rank_(rank), world_(world), device_(device), local_base_(local_base), peer_bases_(std::move(peer_bases)),
        n_send_(n_send) {
    if (world < 1 || world > kMaxW) throw std::invalid_argument("Lane: world size must be in [1, 64]");
    if ((int)peer_bases_.size() != world) throw std::invalid_argument("Lane: need one heap base per rank");
    if (n_send < 1) throw std::invalid_argument("Lane: n_send must be >= 1");
    CP_CUDA(cudaSetDevice(device_));
    CP_CUDA(cudaGetDeviceProperties(&props_, device_));
    auto& ss = lane_streams(device_, 2 + n_send_);
    local_ = ss[0];
    recv_ = ss[1];
    send_.assign(ss.begin() + 2, ss.begin() + 2 + n_send_);
    const int per_slot = 2 + world_ + 2 * n_send_;  // begin, (spare), src[W], send_end[n], tmp[n]
    events_.resize((size_t)kNRec * per_slot);
    for (auto& e : events_) CP_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    // zero our control block (peers have not been told our heap is live until the Python barrier)
    CP_CUDA(cudaMemset(reinterpret_cast<void*>(local_base_), 0, ctrl_bytes()));
    CP_CUDA(cudaDeviceSynchronize());
  }

  // No device sync in the destructor: at interpreter exit a peer may be gone; explicit release() syncs.
  ~Lane() = default;

  void release() {
    if (released_) return;
    released_ = true;
    cudaSetDevice(device_);
    cudaDeviceSynchronize();
    for (auto e : events_) cudaEventDestroy(e);
    events_.clear();
    send_.clear();
  }

  static uint64_t ctrl_bytes() { return 64 * 1024; }

  // Launch one call. descs[t] = the copies whose destination is rank t (descs[rank] = local copy).
  // path 0 = copy engine, 1 = SM kernel. inflight = remote targets in flight at once (send stream groups);
  // split = streams per target (CE only). Targets are visited rank^j (W a power of two) or (rank+j)%W.
  void launch(uint64_t cur_stream, int64_t call, const std::vector<std::vector<std::array<uint64_t, 6>>>& descs,
              int path, int inflight, int split, int sm_blocks) {
    check_live();
    if ((int)descs.size() != world_) throw std::invalid_argument("launch: need one descriptor list per rank");
    if (path == 1) split = 1;
    if (inflight < 1) inflight = 1;
    if (inflight > std::max(1, world_ - 1)) inflight = std::max(1, world_ - 1);
    if (split < 1) split = 1;
    if (inflight * split > n_send_) throw std::invalid_argument("launch: inflight*split exceeds the lane's send streams");
    CP_CUDA(cudaSetDevice(device_));
    const int slot = (int)(call % kNRec);
    cudaStream_t cur = reinterpret_cast<cudaStream_t>(cur_stream);
    uint64_t* ctrl = reinterpret_cast<uint64_t*>(local_base_);
    uint64_t* rec = ctrl + 2 * world_ + 1 + slot;

    PtrList pr{};
    for (int p = 0; p < world_; ++p)
      if (p != rank_) pr.p[pr.n++] = peer_bases_[p] + 8ull * rank_;  // ready[rank] on p
    begin_kernel<<<1, 32, 0, cur>>>(ctrl + 2 * world_, rec, pr);
    CP_CUDA(cudaGetLastError());
    CP_CUDA(cudaEventRecord(ev_begin(slot), cur));

    // local chunk
    CP_CUDA(cudaStreamWaitEvent(local_, ev_begin(slot), 0));
    copies(local_, descs[rank_], local_base_, path, sm_blocks, 0, 1);
    CP_CUDA(cudaEventRecord(ev_src(slot, rank_), local_));

    // remote chunks
    std::vector<int> targets;
    const bool pow2 = (world_ & (world_ - 1)) == 0;
    for (int j = 1; j < world_; ++j) targets.push_back(pow2 ? (rank_ ^ j) : (rank_ + j) % world_);
    const int used = std::min<int>(inflight, (int)targets.size()) * split;
    for (int s = 0; s < used; ++s) CP_CUDA(cudaStreamWaitEvent(send_[s], ev_begin(slot), 0));
    for (size_t j = 0; j < targets.size(); ++j) {
      const int t = targets[j];
      const int g = (int)(j % inflight);
      uint64_t* peer_arrived = reinterpret_cast<uint64_t*>(peer_bases_[t] + 8ull * (world_ + rank_));
      if (path == 1) {  // SM: one fused kernel waits for ready[t], copies, raises arrived on t
        cudaStream_t s = send_[g];
        unsigned int* cnt = reinterpret_cast<unsigned int*>(ctrl + 2 * world_ + 1 + kNRec + g);
        if (!copies(s, descs[t], peer_bases_[t], path, sm_blocks, 0, 1, ctrl + t, rec, peer_arrived, cnt)) {
          wait_kernel<<<1, 32, 0, s>>>(ctrl + t, rec);
          signal_kernel<<<1, 32, 0, s>>>(peer_arrived, rec);
          CP_CUDA(cudaGetLastError());
        }
        continue;
      }
      for (int q = 0; q < split; ++q) {
        cudaStream_t s = send_[g * split + q];
        wait_kernel<<<1, 32, 0, s>>>(ctrl + t, rec);  // ready[t] >= e
        CP_CUDA(cudaGetLastError());
        copies(s, descs[t], peer_bases_[t], path, sm_blocks, q, split);
        if (q > 0) {
          CP_CUDA(cudaEventRecord(ev_tmp(slot, g * split + q), s));
          CP_CUDA(cudaStreamWaitEvent(send_[g * split], ev_tmp(slot, g * split + q), 0));
        }
      }
      signal_kernel<<<1, 32, 0, send_[g * split]>>>(peer_arrived, rec);
      CP_CUDA(cudaGetLastError());
    }
    for (int s = 0; s < used; ++s) CP_CUDA(cudaEventRecord(ev_send_end(slot, s), send_[s]));

    used_[slot] = used;  // arrivals are awaited on the consumer's stream, in wait()/wait_source()
  }

  // Make `stream` wait for every chunk of `call`: the epoch record (begin), a spin on every peer's arrival
  // flag, our own chunk and our sends (joined so a CUDA-graph capture closes every forked stream).
  void wait(uint64_t stream, int64_t call) {
    check_live();
    CP_CUDA(cudaSetDevice(device_));
    const int slot = (int)(call % kNRec);
    cudaStream_t x = reinterpret_cast<cudaStream_t>(stream);
    uint64_t* ctrl = reinterpret_cast<uint64_t*>(local_base_);
    CP_CUDA(cudaStreamWaitEvent(x, ev_begin(slot), 0));
    if (world_ > 1) {
      wait_all_kernel<<<1, 64, 0, x>>>(ctrl + world_, world_, rank_, ctrl + 2 * world_ + 1 + slot);
      CP_CUDA(cudaGetLastError());
    }
    CP_CUDA(cudaStreamWaitEvent(x, ev_src(slot, rank_), 0));
    for (int s = 0; s < used_[slot]; ++s) CP_CUDA(cudaStreamWaitEvent(x, ev_send_end(slot, s), 0));
  }

  // Make `stream` wait for the chunk of group rank `src` only.
  void wait_source(uint64_t stream, int64_t call, int src) {
    check_live();
    if (src < 0 || src >= world_) throw std::invalid_argument("wait_source: source rank out of range");
    CP_CUDA(cudaSetDevice(device_));
    const int slot = (int)(call % kNRec);
    cudaStream_t x = reinterpret_cast<cudaStream_t>(stream);
    uint64_t* ctrl = reinterpret_cast<uint64_t*>(local_base_);
    if (src == rank_) {
      CP_CUDA(cudaStreamWaitEvent(x, ev_src(slot, rank_), 0));
      return;
    }
    CP_CUDA(cudaStreamWaitEvent(x, ev_begin(slot), 0));
    wait_kernel<<<1, 32, 0, x>>>(ctrl + world_ + src, ctrl + 2 * world_ + 1 + slot);
    CP_CUDA(cudaGetLastError());
  }

  // True when our side of `call` is done (own chunk and sends); arrivals from peers are not queried.
  bool query(int64_t call) {
    check_live();
    const int slot = (int)(call % kNRec);
    std::vector<cudaEvent_t> evs{ev_src(slot, rank_)};
    for (int s = 0; s < used_[slot]; ++s) evs.push_back(ev_send_end(slot, s));
    for (auto ev : evs) {
      cudaError_t e = cudaEventQuery(ev);
      if (e == cudaErrorNotReady) return false;
      CP_CUDA(e);
    }
    return true;
  }

  // Device epoch counter and the peers' flags as seen here (diagnostics; synchronizes the device).
  std::vector<uint64_t> control_words() {
    check_live();
    CP_CUDA(cudaSetDevice(device_));
    CP_CUDA(cudaDeviceSynchronize());
    std::vector<uint64_t> w(2 * world_ + 1);
    CP_CUDA(cudaMemcpy(w.data(), reinterpret_cast<void*>(local_base_), w.size() * 8, cudaMemcpyDeviceToHost));
    return w;
  }

  std::vector<uint64_t> streams() const {
    std::vector<uint64_t> r{reinterpret_cast<uint64_t>(local_), reinterpret_cast<uint64_t>(recv_)};
    for (auto s : send_) r.push_back(reinterpret_cast<uint64_t>(s));
    return r;
  }

  int sm_count() const { return props_.multiProcessorCount; }

 private:
  void check_live() const {
    if (released_) throw std::runtime_error("cp_ops fast transport: the lane was shut down (fast.shutdown())");
  }
  int per_slot() const { return 2 + world_ + 2 * n_send_; }
  cudaEvent_t ev_begin(int s) { return events_[(size_t)s * per_slot()]; }
  cudaEvent_t ev_src(int s, int p) { return events_[(size_t)s * per_slot() + 2 + p]; }
  cudaEvent_t ev_send_end(int s, int i) { return events_[(size_t)s * per_slot() + 2 + world_ + i]; }
  cudaEvent_t ev_tmp(int s, int i) { return events_[(size_t)s * per_slot() + 2 + world_ + n_send_ + i]; }

  // Issue part q of `split` of every copy in ds to `stream`; destination heap base `base`.
  // SM path only: wait_flag/peer_flag fuse the ready wait (first launch) and the arrival signal (last
  // launch) into the copy kernel; returns false when no kernel was launched (nothing to copy).
  bool copies(cudaStream_t stream, const std::vector<std::array<uint64_t, 6>>& ds, uint64_t base, int path,
              int sm_blocks, int q, int split, const uint64_t* wait_flag = nullptr, const uint64_t* rec = nullptr,
              uint64_t* peer_flag = nullptr, unsigned int* block_count = nullptr) {
    std::vector<Desc> parts;
    for (const auto& a : ds) {
      Desc d{a[0], a[1], a[2], a[3], a[4], a[5]};
      if (d.width == 0 || d.height == 0) continue;
      if (split > 1) {
        if (d.height >= (uint64_t)split) {  // split rows
          const uint64_t r0 = d.height * q / split, r1 = d.height * (q + 1) / split;
          d.dst_off += r0 * d.dpitch;
          d.src += r0 * d.spitch;
          d.height = r1 - r0;
        } else {  // split each row by 16-byte-aligned byte ranges
          const uint64_t units = (d.width + 15) / 16;
          const uint64_t c0 = std::min(d.width, units * q / split * 16), c1 = std::min(d.width, units * (q + 1) / split * 16);
          d.dst_off += c0;
          d.src += c0;
          d.width = c1 - c0;
        }
        if (d.width == 0 || d.height == 0) continue;
      }
      parts.push_back(d);
    }
    if (path == 0) {
      for (const auto& d : parts) {
        void* dst = reinterpret_cast<void*>(base + d.dst_off);
        const void* src = reinterpret_cast<const void*>(d.src);
        if (d.height == 1 || (d.width == d.dpitch && d.width == d.spitch))
          CP_CUDA(cudaMemcpyAsync(dst, src, d.width * d.height, cudaMemcpyDefault, stream));
        else
          CP_CUDA(cudaMemcpy2DAsync(dst, d.dpitch, src, d.spitch, d.width, d.height, cudaMemcpyDefault, stream));
      }
      return !parts.empty();
    }
    std::vector<CopyBatch> batches;
    for (size_t i0 = 0; i0 < parts.size(); i0 += kMaxDesc) {
      CopyBatch b{};
      unsigned long long acc = 0;
      for (size_t i = i0; i < parts.size() && b.n < kMaxDesc; ++i) {
        const Desc& d = parts[i];
        if ((d.width | d.dpitch | d.spitch | (base + d.dst_off) | d.src) & 15)
          throw std::invalid_argument("SM copy path needs 16-byte aligned pointers, widths and pitches");
        b.dst[b.n] = base + d.dst_off;
        b.src[b.n] = d.src;
        b.dpitch[b.n] = d.dpitch;
        b.spitch[b.n] = d.spitch;
        if ((d.width / 16) * d.height >= (1ull << 32))
          throw std::invalid_argument("SM copy path: one copy must be under 64 GiB");
        b.vpr[b.n] = (unsigned int)(d.width / 16);
        b.start[b.n] = acc;
        acc += (unsigned long long)(d.width / 16) * d.height;
        ++b.n;
      }
      b.start[b.n] = acc;
      if (acc > 0) batches.push_back(b);
    }
    for (size_t i = 0; i < batches.size(); ++i) {
      const CopyBatch& b = batches[i];
      const unsigned long long acc = b.start[b.n];
      const unsigned long long need = (acc + (unsigned long long)kThreads * kUnroll - 1) / ((unsigned long long)kThreads * kUnroll);
      const int blocks = (int)std::max<unsigned long long>(1, std::min<unsigned long long>(need, (unsigned long long)sm_blocks));
      const bool last = i + 1 == batches.size();
      copy2d_kernel<<<blocks, kThreads, 0, stream>>>(b, i == 0 ? wait_flag : nullptr, rec, last ? peer_flag : nullptr,
                                                     block_count);
      CP_CUDA(cudaGetLastError());
    }
    return !batches.empty();
  }

  int rank_, world_, device_;
  uint64_t local_base_;
  std::vector<uint64_t> peer_bases_;
  int n_send_;
  cudaDeviceProp props_{};
  cudaStream_t local_{}, recv_{};
  std::vector<cudaStream_t> send_;
  std::vector<cudaEvent_t> events_;
  int used_[kNRec] = {0};
  bool released_ = false;
};

// ---- heap helpers for the CUDA-IPC backend and fabric probing ------------------------------------
uint64_t ipc_malloc(int device, uint64_t bytes) {
  CP_CUDA(cudaSetDevice(device));
  void* p = nullptr;
  CP_CUDA(cudaMalloc(&p, bytes));
  return reinterpret_cast<uint64_t>(p);
}

py::bytes ipc_handle(int device, uint64_t ptr) {
  CP_CUDA(cudaSetDevice(device));
  cudaIpcMemHandle_t h;
  CP_CUDA(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(ptr)));
  return py::bytes(reinterpret_cast<const char*>(&h), sizeof(h));
}

uint64_t ipc_open(int device, py::bytes handle) {
  CP_CUDA(cudaSetDevice(device));
  std::string s = handle;
  if (s.size() != sizeof(cudaIpcMemHandle_t)) throw std::invalid_argument("ipc_open: bad handle size");
  cudaIpcMemHandle_t h;
  memcpy(&h, s.data(), sizeof(h));
  void* p = nullptr;
  CP_CUDA(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<uint64_t>(p);
}

void ipc_close(int device, uint64_t ptr) {
  cudaSetDevice(device);
  cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr));
}

void device_free(int device, uint64_t ptr) {
  cudaSetDevice(device);
  cudaFree(reinterpret_cast<void*>(ptr));
}

// (can access peer, native atomics over the link, performance rank) between two local device ordinals.
std::vector<int> p2p_attributes(int dev, int peer) {
  int access = 0, atomics = 0, perf = 0;
  CP_CUDA(cudaDeviceCanAccessPeer(&access, dev, peer));
  if (access) {
    CP_CUDA(cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, dev, peer));
    CP_CUDA(cudaDeviceGetP2PAttribute(&perf, cudaDevP2PAttrPerformanceRank, dev, peer));
  }
  return {access, atomics, perf};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cp_ops fast transport kernels: peer-write AGKV/Ulysses lanes (copy engine + SM copy), flags";
  py::class_<Lane>(m, "Lane")
      .def(py::init<int, int, int, uint64_t, std::vector<uint64_t>, int>(), py::arg("rank"), py::arg("world"),
           py::arg("device"), py::arg("local_base"), py::arg("peer_bases"), py::arg("n_send"))
      .def("launch", &Lane::launch, py::arg("cur_stream"), py::arg("call"), py::arg("descs"), py::arg("path"),
           py::arg("inflight"), py::arg("split"), py::arg("sm_blocks"))
      .def("wait", &Lane::wait)
      .def("wait_source", &Lane::wait_source)
      .def("query", &Lane::query)
      .def("control_words", &Lane::control_words)
      .def("streams", &Lane::streams)
      .def("sm_count", &Lane::sm_count)
      .def("release", &Lane::release)
      .def_static("ctrl_bytes", &Lane::ctrl_bytes);
  m.def("ipc_malloc", &ipc_malloc);
  m.def("ipc_handle", &ipc_handle);
  m.def("ipc_open", &ipc_open);
  m.def("ipc_close", &ipc_close);
  m.def("device_free", &device_free);
  m.def("p2p_attributes", &p2p_attributes);
}

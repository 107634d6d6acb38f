// cp_ops fast transport: direct peer writes (copy engine or SM copy kernel) with per-call-slot flags.
//
// One `Lane` per process = one CP group on one node. The lane is given a control block in symmetric memory:
// a local base pointer and, for every group rank, the address of that rank's control block as mapped into
// this process (NVSHMEM nvshmem_ptr, or CUDA IPC). Pool buffers are separate symmetric allocations; a launch
// names its destinations as absolute pointers (descs[t] = copies into rank t's buffers, already translated).
//
// Control block (uint64 words; S = call slots, W = group width):
//   gen[S]        gen[s] = how many calls used slot s here (the slot's generation; raised by our begin kernel)
//   ready[S][W]   ready[s][p] = gen of the call in slot s at which rank p allowed us to write into p's buffers
//                 (written by p's begin kernel, i.e. after every earlier op on p's stream)
//   arrived[S][W] arrived[s][p] = gen of the call in slot s whose data rank p finished writing into our buffers
//   blocks[n]     per send stream: blocks of the fused SM copy kernel done (the last one signals)
//   err_claim     0 until a device wait times out here (the first one to time out writes the error record)
//
// Why per-slot flags (not one arrived[p] per peer): which send stream carries a call's signal depends on the
// per-shape tuned decision, so two calls in flight can signal one target out of order; with one flag per
// source the later call's flag can land first (stale data, then a lowered flag and a hang). A slot holds one
// call at a time: the host gives slots round-robin (same sequence on every rank), refuses to reuse a slot whose
// call was not waited yet, and the next begin kernel of a slot waits (on the device) for the previous call's
// wait to finish; so on every rank the generations of a slot advance in the same order, a flag of slot s is
// written by exactly one call at a time, and no peer atomics are needed (plain release stores: PCIe-safe).
//
// A call (launch), slot s:
//   cur stream:   [wait for slot s's previous wait]; begin kernel: g = ++gen[s]; ready[s][rank] := g on every
//                 peer; spin until ready[s][t] >= g for every peer t (the rendezvous)   -> event begin
//   local stream: copy own chunk into own buffer                         -> event src
//   send streams: per target t, after event begin: copy (CE memcpy2D or SM kernel) into t's buffer;
//                 arrived[s][rank] := g on t (release, system scope); the SM path fuses both per target
// (The readiness spin sits in the begin kernel, not on the send streams: a spin kernel there needs an SM and,
// behind a full-occupancy kernel issued after the launch -- the attention the transfer should hide under --,
// measured on 2x H200 to start only at that kernel's tail, so the copy ran after it instead of under it.)
// `wait(stream, slot)`: wait for begin, spin until arrived[s][p] >= g for every peer, join local and send
// streams, record the slot's done event. `wait_source(stream, slot, p)` spins on arrived[s][p] only.
//
// Bounded waits: every spin gives up after `timeout_ns` (%globaltimer) or at once when another wait on this
// device already timed out, and the first one records (call, slot, peer, flag, value seen, wanted, waited ns)
// in mapped pinned host memory; the host raises it (Lane.error()) at its next launch/wait/check. A wait (or
// wait_source) whose spin gave up poisons the call's outputs on this rank (every byte 0xFF: NaN in every float
// dtype) before its stream goes on, so nothing computed from data that never arrived looks normal.
//
// A call never waited (cancelled, or its work dropped after an exception between launch and wait) records no done
// event; the next launch in its slot then waits for that call's begin, own copy and sends instead, so the slot's
// generations and arrival signals still advance in order.
//
// CUDA graphs: a launch captured into a graph gives the graph a CUDA user object; when the graph (and every
// executable made from it) is destroyed, its destructor queues the slot, and `freed_slots()` hands the queue to
// the host (CallSlots reclaims a slot once every rank saw it freed).
#include <cuda_runtime.h>
#ifndef __CUDA_ARCH__  // pybind11 in the host pass only: the device pass compiles the kernels without parsing it
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#else
#pragma nv_diag_suppress 177  // (the device pass sees the host functions, not the binding that uses them)
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef __CUDA_ARCH__
namespace py = pybind11;
#endif

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
constexpr int kMaxDesc = 16;  // copies per SM-kernel launch
constexpr int kThreads = 512;
constexpr int kUnroll = 4;

enum Flag : uint64_t { kReady = 1, kArrived = 2, kSource = 3 };

// Host-visible error record (mapped pinned memory). `valid` is written last.
struct ErrRec {
  uint64_t valid, flag, call, slot, peer, seen, want, waited_ns;
};

struct Ctx {  // what a spin needs to give up and report
  ErrRec* err;             // device pointer of the mapped host record
  unsigned long long* claim;  // device word: 0 until the first timeout
  uint64_t timeout_ns;
  long long call;
  int slot;
};

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spin until *flag >= want; false (and the error recorded once per device) after the timeout or when
// another wait already timed out.
__device__ bool spin_geq(const uint64_t* flag, uint64_t want, const Ctx& c, uint64_t kind, int peer) {
  uint64_t v = ld_acquire_sys(flag);
  if (v >= want) return true;
  const uint64_t t0 = now_ns();
  for (;;) {
    __nanosleep(100);
    v = ld_acquire_sys(flag);
    if (v >= want) return true;
    if (*(volatile unsigned long long*)c.claim != 0) return false;  // someone timed out: give up now
    const uint64_t dt = now_ns() - t0;
    if (dt > c.timeout_ns) {
      if (atomicCAS(c.claim, 0ull, 1ull) == 0ull) {
        volatile ErrRec* e = c.err;
        e->flag = kind;
        e->call = (uint64_t)c.call;
        e->slot = (uint64_t)c.slot;
        e->peer = (uint64_t)peer;
        e->seen = v;
        e->want = want;
        e->waited_ns = dt;
        __threadfence_system();
        e->valid = 1;
        __threadfence_system();
      }
      return false;
    }
  }
}

struct PtrList {
  int n;
  unsigned long long p[kMaxW];
};

constexpr int kMaxPoison = 4;  // output buffers per call (AGKV: k_full, v_full)

// Output buffers of one call on this rank, filled with 0xFF bytes (NaN) when its wait gives up.
struct PoisonList {
  int n;
  unsigned long long ptr[kMaxPoison];
  unsigned long long bytes[kMaxPoison];
};

// Every thread of the block fills the regions (16-byte stores where aligned, bytes at the edges).
__device__ void poison(const PoisonList& pl) {
  const int4 nan4 = make_int4(-1, -1, -1, -1);
  for (int i = 0; i < pl.n; ++i) {
    unsigned char* p = reinterpret_cast<unsigned char*>(pl.ptr[i]);
    const unsigned long long n = pl.bytes[i];
    const unsigned long long head = min(n, (unsigned long long)((16 - (pl.ptr[i] & 15)) & 15));
    const unsigned long long vecs = (n - head) / 16;
    for (unsigned long long j = threadIdx.x; j < head; j += blockDim.x) p[j] = 0xFF;
    int4* v = reinterpret_cast<int4*>(p + head);
    for (unsigned long long j = threadIdx.x; j < vecs; j += blockDim.x) v[j] = nan4;
    for (unsigned long long j = head + vecs * 16 + threadIdx.x; j < n; j += blockDim.x) p[j] = 0xFF;
  }
  __threadfence();
}

// g = ++gen; ready[s][rank] := g on every peer; then spin until every peer's ready[s][t] >= g here (one thread
// per peer): the rendezvous. It runs on the caller's stream, so the send streams start their copies on an
// event, with no kernel of their own in front: a spin kernel queued on a send stream needs a free SM and, behind
// a full-occupancy kernel (the attention the transfer should hide under), waited for that kernel's tail.
__global__ void begin_kernel(uint64_t* gen, PtrList peers_ready, const uint64_t* my_ready, int world, int rank,
                             Ctx c) {
  __shared__ uint64_t g;
  if (threadIdx.x == 0) {
    g = *gen + 1;
    *gen = g;
    __threadfence_system();
    for (int i = 0; i < peers_ready.n; ++i) st_release_sys(reinterpret_cast<uint64_t*>(peers_ready.p[i]), g);
  }
  __syncthreads();
  for (int p = threadIdx.x; p < world; p += blockDim.x) {
    if (p == rank) continue;
    spin_geq(my_ready + p, g, c, kReady, p);
  }
  __syncthreads();
  if (threadIdx.x == 0) __threadfence_system();
}

// One source's arrival (wait_source); the call's outputs poisoned if the spin gave up.
__global__ void wait_kernel(const uint64_t* flag, const uint64_t* gen, Ctx c, uint64_t kind, int peer,
                            const PoisonList pl) {
  __shared__ int bad;
  if (threadIdx.x == 0) {
    bad = spin_geq(flag, *gen, c, kind, peer) ? 0 : 1;
    __threadfence_system();
  }
  __syncthreads();
  if (bad) poison(pl);
}

// Spin until arrived[p] >= *gen for every p != rank (one thread per source); the call's outputs poisoned if a
// spin gave up.
__global__ void wait_all_kernel(const uint64_t* arrived, int world, int rank, const uint64_t* gen, Ctx c,
                                const PoisonList pl) {
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  const uint64_t g = *gen;
  for (int p = threadIdx.x; p < world; p += blockDim.x) {
    if (p == rank) continue;
    if (!spin_geq(arrived + p, g, c, kArrived, p)) atomicExch(&bad, 1);
  }
  __syncthreads();
  if (bad) poison(pl);
  if (threadIdx.x == 0) __threadfence_system();
}

__global__ void signal_kernel(uint64_t* peer_flag, const uint64_t* gen, const unsigned long long* claim) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    __threadfence_system();
    if (*(volatile const unsigned long long*)claim == 0) st_release_sys(peer_flag, *gen);
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
// Fused flags (SM path): if wait_flag, every block first spins until *wait_flag >= *gen (the target's
// ready flag; a block that gives up copies nothing; without it, a block copies nothing once a device wait here
// timed out); if peer_flag, the last block to finish (counted in
// *block_count, reset after) stores *gen there with release semantics at system scope, after a system fence
// that covers every block's stores, unless a wait on this device timed out.
__global__ void __launch_bounds__(kThreads) copy2d_kernel(const __grid_constant__ CopyBatch b, const uint64_t* wait_flag,
                                                          const uint64_t* gen, uint64_t* peer_flag,
                                                          unsigned int* block_count, Ctx c, int peer) {
  __shared__ int ok;
  // no wait_flag (the rendezvous in begin_kernel already waited): copy unless a device wait here timed out
  if (threadIdx.x == 0)
    ok = wait_flag == nullptr ? (int)(*(volatile unsigned long long*)c.claim == 0)
                              : (int)spin_geq(wait_flag, *gen, c, kReady, peer);
  __syncthreads();
  const unsigned long long total = ok ? b.start[b.n] : 0;
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
        if (*(volatile unsigned long long*)c.claim == 0) st_release_sys(peer_flag, *gen);
      }
    }
  }
}

// One 2-D copy: dst is an absolute pointer valid in this process (a peer's buffer as mapped here).
struct Desc {
  uint64_t dst, src, width, height, dpitch, spitch;
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

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  CP_CUDA(cudaStreamIsCapturing(s, &st));
  return st != cudaStreamCaptureStatusNone;
}

// Slots whose CUDA graph was destroyed (filled by user-object destructors on CUDA's internal thread, drained by
// the host); shared with the pending destructors, so it outlives a released lane.
struct FreedQueue {
  std::mutex mu;
  std::vector<int> slots;
};

struct FreedNote {  // one captured launch's user object: the queue and the slot
  std::shared_ptr<FreedQueue> q;
  int slot;
};

void CUDART_CB on_graph_freed(void* p) {  // no CUDA calls allowed here
  FreedNote* note = static_cast<FreedNote*>(p);
  {
    std::lock_guard<std::mutex> lock(note->q->mu);
    note->q->slots.push_back(note->slot);
  }
  delete note;
}

class Lane {
 public:
  Lane(int rank, int world, int device, uint64_t ctrl, std::vector<uint64_t> peer_ctrl, int n_send, int n_slots,
       double timeout_s)
      : rank_(rank), world_(world), device_(device), ctrl_(ctrl), peer_ctrl_(std::move(peer_ctrl)), n_send_(n_send),
        n_slots_(n_slots) {
    if (world < 1 || world > kMaxW) throw std::invalid_argument("Lane: world size must be in [1, 64]");
    if ((int)peer_ctrl_.size() != world) throw std::invalid_argument("Lane: need one control block per rank");
    if (n_send < 1) throw std::invalid_argument("Lane: n_send must be >= 1");
    if (n_slots < 1) throw std::invalid_argument("Lane: n_slots must be >= 1");
    set_timeout(timeout_s);
    CP_CUDA(cudaSetDevice(device_));
    auto& ss = lane_streams(device_, 1 + n_send_);
    local_ = ss[0];
    send_.assign(ss.begin() + 1, ss.begin() + 1 + n_send_);
    slots_.resize(n_slots_);
    for (auto& sl : slots_) {  // all events up front: nothing is created while a CUDA graph is being captured
      sl.events.resize(kEvTmp0 + 2 * n_send_);
      for (auto& e : sl.events) CP_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    CP_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&err_host_), sizeof(ErrRec), cudaHostAllocMapped));
    std::memset(err_host_, 0, sizeof(ErrRec));
    CP_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&err_dev_), err_host_, 0));
    // zero our control block (peers have not been told our heap is live until the Python barrier)
    CP_CUDA(cudaMemset(reinterpret_cast<void*>(ctrl_), 0, ctrl_bytes(world_, n_slots_, n_send_)));
    CP_CUDA(cudaDeviceSynchronize());
  }

  // No device sync in the destructor: at interpreter exit a peer may be gone; explicit release() syncs.
  ~Lane() = default;

  void release() {
    if (released_) return;
    released_ = true;
    cudaSetDevice(device_);
    cudaDeviceSynchronize();
    for (auto& sl : slots_)
      for (auto e : sl.events) cudaEventDestroy(e);
    slots_.clear();
    send_.clear();
    if (err_host_) cudaFreeHost(err_host_);
    err_host_ = nullptr;
  }

  static uint64_t ctrl_bytes(int world, int n_slots, int n_send) {
    const uint64_t words = (uint64_t)n_slots * (1 + 2 * (uint64_t)world) + (uint64_t)n_send + 8;
    return (words * 8 + 4095) / 4096 * 4096;
  }

  void set_timeout(double timeout_s) {
    if (!(timeout_s > 0)) throw std::invalid_argument("Lane: timeout must be > 0 s");
    timeout_ns_ = (uint64_t)(timeout_s * 1e9);
  }

  // Launch one call in `slot` (host call index `call`, for error reports). descs[t] = the copies whose
  // destination is rank t (descs[rank] = local copy), destinations as absolute pointers.
  // path 0 = copy engine, 1 = SM kernel. inflight = remote targets in flight at once (send stream groups);
  // split = streams per target (CE only). Targets are visited rank^j (W a power of two) or (rank+j)%W.
  // outputs = (address, bytes) of this rank's output buffers (poisoned when a wait of this call gives up).
  void launch(uint64_t cur_stream, int64_t call, int slot, const std::vector<std::vector<std::array<uint64_t, 6>>>& descs,
              int path, int inflight, int split, int sm_blocks, const std::vector<std::array<uint64_t, 2>>& outputs) {
    check_live();
    check_slot(slot);
    if ((int)descs.size() != world_) throw std::invalid_argument("launch: need one descriptor list per rank");
    if ((int)outputs.size() > kMaxPoison) throw std::invalid_argument("launch: more than 4 output buffers");
    if (path == 1) split = 1;
    if (inflight < 1) inflight = 1;
    if (inflight > std::max(1, world_ - 1)) inflight = std::max(1, world_ - 1);
    if (split < 1) split = 1;
    if (inflight * split > n_send_) throw std::invalid_argument("launch: inflight*split exceeds the lane's send streams");
    CP_CUDA(cudaSetDevice(device_));
    Slot& sl = slot_events(slot);
    cudaStream_t cur = reinterpret_cast<cudaStream_t>(cur_stream);
    uint64_t* gen = gen_ptr(slot);
    const Ctx c = ctx(call, slot);

    // the slot's previous call must be fully waited on this device before its generation moves on; one never
    // waited (cancelled or dropped) has no done event: wait for its begin, own copy and sends instead
    const bool cap = capturing(cur);
    if (!cap && sl.done_valid) {
      CP_CUDA(cudaStreamWaitEvent(cur, sl.events[kEvDone], 0));
    } else if (!cap && sl.call >= 0 && !sl.captured) {
      CP_CUDA(cudaStreamWaitEvent(cur, sl.events[kEvBegin], 0));
      CP_CUDA(cudaStreamWaitEvent(cur, sl.events[kEvSrc], 0));
      for (int q = 0; q < sl.used; ++q) CP_CUDA(cudaStreamWaitEvent(cur, sl.events[kEvTmp0 + q], 0));
    }
    sl.done_valid = false;
    if (cap) note_graph(cur, slot);
    PtrList pr{};
    for (int p = 0; p < world_; ++p)
      if (p != rank_) pr.p[pr.n++] = peer_ctrl_[p] + 8ull * ready_index(slot, rank_);
    begin_kernel<<<1, 64, 0, cur>>>(gen, pr, ctrl_words() + ready_index(slot, 0), world_, rank_, c);
    CP_CUDA(cudaGetLastError());
    CP_CUDA(cudaEventRecord(sl.events[kEvBegin], cur));

    // local chunk
    CP_CUDA(cudaStreamWaitEvent(local_, sl.events[kEvBegin], 0));
    copies(local_, descs[rank_], path, sm_blocks, 0, 1, c);
    CP_CUDA(cudaEventRecord(sl.events[kEvSrc], local_));

    // remote chunks
    std::vector<int> targets;
    const bool pow2 = (world_ & (world_ - 1)) == 0;
    for (int j = 1; j < world_; ++j) targets.push_back(pow2 ? (rank_ ^ j) : (rank_ + j) % world_);
    const int used = std::min<int>(inflight, (int)targets.size()) * split;
    for (int s = 0; s < used; ++s) CP_CUDA(cudaStreamWaitEvent(send_[s], sl.events[kEvBegin], 0));
    for (size_t j = 0; j < targets.size(); ++j) {
      const int t = targets[j];
      const int g = (int)(j % inflight);
      uint64_t* peer_arrived = reinterpret_cast<uint64_t*>(peer_ctrl_[t] + 8ull * arrived_index(slot, rank_));
      // ready[s][t] >= g held at the begin event (the rendezvous): the send streams copy at once
      if (path == 1) {  // SM: one fused kernel copies and raises arrived[s][rank] on t
        cudaStream_t s = send_[g];
        unsigned int* cnt = reinterpret_cast<unsigned int*>(ctrl_words() + blocks_index(g));
        if (!copies(s, descs[t], path, sm_blocks, 0, 1, c, nullptr, gen, peer_arrived, cnt, t)) {
          signal_kernel<<<1, 32, 0, s>>>(peer_arrived, gen, claim_ptr());
          CP_CUDA(cudaGetLastError());
        }
        continue;
      }
      for (int q = 0; q < split; ++q) {
        cudaStream_t s = send_[g * split + q];
        copies(s, descs[t], path, sm_blocks, q, split, c);
        if (q > 0) {
          CP_CUDA(cudaEventRecord(sl.events[kEvTmp0 + n_send_ + g * split + q], s));
          CP_CUDA(cudaStreamWaitEvent(send_[g * split], sl.events[kEvTmp0 + n_send_ + g * split + q], 0));
        }
      }
      signal_kernel<<<1, 32, 0, send_[g * split]>>>(peer_arrived, gen, claim_ptr());
      CP_CUDA(cudaGetLastError());
    }
    for (int s = 0; s < used; ++s) CP_CUDA(cudaEventRecord(sl.events[kEvTmp0 + s], send_[s]));
    sl.used = used;
    sl.call = call;
    sl.captured = cap;
    sl.poison = PoisonList{};
    for (const auto& o : outputs) {
      sl.poison.ptr[sl.poison.n] = o[0];
      sl.poison.bytes[sl.poison.n] = o[1];
      ++sl.poison.n;
    }
  }

  // Make `stream` wait for every chunk of the call in `slot`: begin, a spin on every peer's arrival flag,
  // our own chunk and our sends (joined so a CUDA-graph capture closes every forked stream). `record_done`:
  // record the slot's done event (the slot's next begin waits for it; not while capturing).
  void wait(uint64_t stream, int slot, bool record_done) {
    check_live();
    check_slot(slot);
    CP_CUDA(cudaSetDevice(device_));
    Slot& sl = slot_events(slot);
    cudaStream_t x = reinterpret_cast<cudaStream_t>(stream);
    CP_CUDA(cudaStreamWaitEvent(x, sl.events[kEvBegin], 0));
    // own copy and sends first, so a poisoning wait kernel is the last writer of the outputs here
    CP_CUDA(cudaStreamWaitEvent(x, sl.events[kEvSrc], 0));
    for (int s = 0; s < sl.used; ++s) CP_CUDA(cudaStreamWaitEvent(x, sl.events[kEvTmp0 + s], 0));
    if (world_ > 1) {
      wait_all_kernel<<<1, 64, 0, x>>>(ctrl_words() + arrived_index(slot, 0), world_, rank_, gen_ptr(slot),
                                       ctx(sl.call, slot), sl.poison);
      CP_CUDA(cudaGetLastError());
    }
    if (record_done && !capturing(x)) {
      CP_CUDA(cudaEventRecord(sl.events[kEvDone], x));
      sl.done_valid = true;
    }
  }

  // Make `stream` wait for the chunk of group rank `src` only.
  void wait_source(uint64_t stream, int slot, int src) {
    check_live();
    check_slot(slot);
    if (src < 0 || src >= world_) throw std::invalid_argument("wait_source: source rank out of range");
    CP_CUDA(cudaSetDevice(device_));
    Slot& sl = slot_events(slot);
    cudaStream_t x = reinterpret_cast<cudaStream_t>(stream);
    if (src == rank_) {
      CP_CUDA(cudaStreamWaitEvent(x, sl.events[kEvSrc], 0));
      return;
    }
    CP_CUDA(cudaStreamWaitEvent(x, sl.events[kEvBegin], 0));
    wait_kernel<<<1, 64, 0, x>>>(ctrl_words() + arrived_index(slot, src), gen_ptr(slot), ctx(sl.call, slot), kSource,
                                 src, sl.poison);
    CP_CUDA(cudaGetLastError());
  }

  // True when our side of the call in `slot` is done (own chunk and sends); peers' arrivals are not queried.
  bool query(int slot) {
    check_live();
    check_slot(slot);
    Slot& sl = slot_events(slot);
    std::vector<cudaEvent_t> evs{sl.events[kEvSrc]};
    for (int s = 0; s < sl.used; ++s) evs.push_back(sl.events[kEvTmp0 + s]);
    for (auto ev : evs) {
      cudaError_t e = cudaEventQuery(ev);
      if (e == cudaErrorNotReady) return false;
      CP_CUDA(e);
    }
    return true;
  }

  // The first device wait that timed out on this lane, or an empty list: [flag, call, slot, peer, seen, want,
  // waited_ns] (flag 1 = ready, 2 = arrived, 3 = wait_source). Reads mapped host memory: no device sync.
  std::vector<uint64_t> error() const {
    if (err_host_ == nullptr) return {};
    volatile ErrRec* e = err_host_;
    if (e->valid == 0) return {};
    return {e->flag, e->call, e->slot, e->peer, e->seen, e->want, e->waited_ns};
  }

  // Every slot's generation as seen here (diagnostics; synchronizes the device).
  std::vector<uint64_t> generations() {
    check_live();
    CP_CUDA(cudaSetDevice(device_));
    CP_CUDA(cudaDeviceSynchronize());
    std::vector<uint64_t> w(n_slots_);
    CP_CUDA(cudaMemcpy(w.data(), reinterpret_cast<void*>(ctrl_), w.size() * 8, cudaMemcpyDeviceToHost));
    return w;
  }

  std::vector<uint64_t> streams() const {
    std::vector<uint64_t> r{reinterpret_cast<uint64_t>(local_)};
    for (auto s : send_) r.push_back(reinterpret_cast<uint64_t>(s));
    return r;
  }

  int n_slots() const { return n_slots_; }

  // Slots whose CUDA graph was destroyed since the last call (see on_graph_freed); no CUDA call.
  std::vector<int> freed_slots() {
    std::lock_guard<std::mutex> lock(freed_->mu);
    std::vector<int> out;
    out.swap(freed_->slots);
    return out;
  }

 private:
  // per-slot events: begin, done (the slot's last full wait), src (own chunk), send_end[n_send], tmp[n_send]
  enum { kEvBegin = 0, kEvDone = 1, kEvSrc = 2, kEvTmp0 = 3 };
  struct Slot {
    std::vector<cudaEvent_t> events;
    int used = 0;
    int64_t call = -1;
    bool done_valid = false;
    bool captured = false;  // its last call was captured into a CUDA graph (its events hold no eager record)
    PoisonList poison{};    // its last call's outputs here
  };

  // The graph being captured on `s` owns a user object whose destructor queues `slot` (graph destroyed).
  void note_graph(cudaStream_t s, int slot) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    cudaGraph_t graph = nullptr;
    CP_CUDA(cudaStreamGetCaptureInfo(s, &st, &id, &graph));
    if (st != cudaStreamCaptureStatusActive || graph == nullptr) return;
    FreedNote* note = new FreedNote{freed_, slot};
    cudaUserObject_t obj;
    cudaError_t e = cudaUserObjectCreate(&obj, note, on_graph_freed, 1, cudaUserObjectNoDestructorSync);
    if (e != cudaSuccess) {
      delete note;
      CP_CUDA(e);
    }
    CP_CUDA(cudaGraphRetainUserObject(graph, obj, 1, cudaGraphUserObjectMove));
  }

  void check_live() const {
    if (released_) throw std::runtime_error("cp_ops fast transport: the lane was shut down (FastTransport.shutdown())");
  }
  void check_slot(int slot) const {
    if (slot < 0 || slot >= n_slots_) throw std::invalid_argument("cp_ops fast transport: call slot out of range");
  }
  Slot& slot_events(int slot) { return slots_[slot]; }
  uint64_t* ctrl_words() const { return reinterpret_cast<uint64_t*>(ctrl_); }
  uint64_t* gen_ptr(int slot) const { return ctrl_words() + slot; }
  uint64_t ready_index(int slot, int p) const { return (uint64_t)n_slots_ + (uint64_t)slot * world_ + p; }
  uint64_t arrived_index(int slot, int p) const {
    return (uint64_t)n_slots_ * (1 + world_) + (uint64_t)slot * world_ + p;
  }
  uint64_t blocks_index(int g) const { return (uint64_t)n_slots_ * (1 + 2 * world_) + g; }
  unsigned long long* claim_ptr() const {
    return reinterpret_cast<unsigned long long*>(ctrl_words() + blocks_index(n_send_));
  }
  Ctx ctx(int64_t call, int slot) const { return Ctx{err_dev_, claim_ptr(), timeout_ns_, (long long)call, slot}; }

  // Issue part q of `split` of every copy in ds to `stream`.
  // SM path only: wait_flag/peer_flag fuse the ready wait (first launch) and the arrival signal (last
  // launch) into the copy kernel; returns false when no kernel was launched (nothing to copy).
  bool copies(cudaStream_t stream, const std::vector<std::array<uint64_t, 6>>& ds, int path, int sm_blocks, int q,
              int split, const Ctx& c, const uint64_t* wait_flag = nullptr, const uint64_t* gen = nullptr,
              uint64_t* peer_flag = nullptr, unsigned int* block_count = nullptr, int peer = -1) {
    std::vector<Desc> parts;
    for (const auto& a : ds) {
      Desc d{a[0], a[1], a[2], a[3], a[4], a[5]};
      if (d.width == 0 || d.height == 0) continue;
      if (split > 1) {
        if (d.height >= (uint64_t)split) {  // split rows
          const uint64_t r0 = d.height * q / split, r1 = d.height * (q + 1) / split;
          d.dst += r0 * d.dpitch;
          d.src += r0 * d.spitch;
          d.height = r1 - r0;
        } else {  // split each row by 16-byte-aligned byte ranges
          const uint64_t units = (d.width + 15) / 16;
          const uint64_t c0 = std::min(d.width, units * q / split * 16), c1 = std::min(d.width, units * (q + 1) / split * 16);
          d.dst += c0;
          d.src += c0;
          d.width = c1 - c0;
        }
        if (d.width == 0 || d.height == 0) continue;
      }
      parts.push_back(d);
    }
    if (path == 0) {
      for (const auto& d : parts) {
        void* dst = reinterpret_cast<void*>(d.dst);
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
        if ((d.width | d.dpitch | d.spitch | d.dst | d.src) & 15)
          throw std::invalid_argument("SM copy path needs 16-byte aligned pointers, widths and pitches");
        b.dst[b.n] = d.dst;
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
      copy2d_kernel<<<blocks, kThreads, 0, stream>>>(b, i == 0 ? wait_flag : nullptr, gen, last ? peer_flag : nullptr,
                                                     block_count, c, peer);
      CP_CUDA(cudaGetLastError());
    }
    return !batches.empty();
  }

  int rank_, world_, device_;
  uint64_t ctrl_;
  std::vector<uint64_t> peer_ctrl_;
  int n_send_, n_slots_;
  uint64_t timeout_ns_ = 0;
  cudaStream_t local_{};
  std::vector<cudaStream_t> send_;
  std::vector<Slot> slots_;
  ErrRec* err_host_ = nullptr;
  ErrRec* err_dev_ = nullptr;
  bool released_ = false;
  std::shared_ptr<FreedQueue> freed_ = std::make_shared<FreedQueue>();
};

// ---- heap helpers for the CUDA-IPC backend and fabric probing ------------------------------------
uint64_t ipc_malloc(int device, uint64_t bytes) {
  CP_CUDA(cudaSetDevice(device));
  void* p = nullptr;
  CP_CUDA(cudaMalloc(&p, bytes));
  return reinterpret_cast<uint64_t>(p);
}

#ifndef __CUDA_ARCH__  // pybind11 types: host pass only
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
#endif

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

#ifndef __CUDA_ARCH__
void register_lse_merge(pybind11::module_& m);  // csrc/lse_merge.cu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cp_ops fast transport kernels: peer-write AGKV/Ulysses lanes (copy engine + SM copy), per-slot flags";
  py::class_<Lane>(m, "Lane")
      .def(py::init<int, int, int, uint64_t, std::vector<uint64_t>, int, int, double>(), py::arg("rank"),
           py::arg("world"), py::arg("device"), py::arg("ctrl"), py::arg("peer_ctrl"), py::arg("n_send"),
           py::arg("n_slots"), py::arg("timeout_s"))
      .def("launch", &Lane::launch, py::arg("cur_stream"), py::arg("call"), py::arg("slot"), py::arg("descs"),
           py::arg("path"), py::arg("inflight"), py::arg("split"), py::arg("sm_blocks"),
           py::arg("outputs") = std::vector<std::array<uint64_t, 2>>{})
      .def("wait", &Lane::wait, py::arg("stream"), py::arg("slot"), py::arg("record_done"))
      .def("wait_source", &Lane::wait_source)
      .def("query", &Lane::query)
      .def("error", &Lane::error)
      .def("set_timeout", &Lane::set_timeout)
      .def("generations", &Lane::generations)
      .def("streams", &Lane::streams)
      .def("n_slots", &Lane::n_slots)
      .def("freed_slots", &Lane::freed_slots)
      .def("release", &Lane::release)
      .def_static("ctrl_bytes", &Lane::ctrl_bytes);
  m.def("ipc_malloc", &ipc_malloc);
  m.def("ipc_handle", &ipc_handle);
  m.def("ipc_open", &ipc_open);
  m.def("ipc_close", &ipc_close);
  m.def("device_free", &device_free);
  m.def("p2p_attributes", &p2p_attributes);
  register_lse_merge(m);
}
#endif  // __CUDA_ARCH__

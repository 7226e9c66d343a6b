// Collectives of tensor-parallel ranks on one host through a shared-memory segment (the uint8 tensor `seg`,
// mapped by every rank: pagoda/distributed/communicator.py ShmCommunicator), as vLLM's and SGLang's CPU backends
// and DeepSpeed do: no sockets, and a call returns as soon as the last peer's data is in (benchmarks/allreduce.py).
//
// Every collective runs in rounds. In round g a rank copies its chunk into its slot of buffer g % 2, publishes g
// in its counter (release), waits until every rank's counter reaches g (acquire), then reads the slots it needs.
// Two buffers suffice: a rank can only write buffer g % 2 again in round g + 2, after it saw every counter reach
// g + 1, and a rank publishes g + 1 only after it finished reading round g. Each rank's counter is also its own
// round count, so the ops keep no state between calls.
//
// The all-reduce sums all slots in rank order 0..N-1 in fp32 and rounds once, the same arithmetic on every
// rank, so all ranks hold bit-identical results (tensor-parallel ranks must keep identical hidden states).
//
// A waiting rank spins briefly (a hot all-reduce returns in µs), then yields, then sleeps with backoff up to
// 1 ms (an idle worker waiting for the next step must not burn its core). Every 50 ms it checks that each
// registered peer still lives, and on every pass the abort flag, so a dead rank or an abort ends every wait.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

namespace {

constexpr uint64_t kMagic = 0x31687363'61676170;  // marks a segment laid out as below
constexpr int64_t kMaxRanks = 64;
constexpr int64_t kHeaderBytes = 8192;

struct alignas(64) RankState {  // one cache line per rank: a rank's counter is written by it alone
  uint64_t round;               // the last round this rank published
  int64_t pid;                  // 0 until the rank registers
};

struct Header {
  uint64_t magic;  // stored last by rank 0's register: attaching ranks see a complete header
  int64_t world_size;
  int64_t slot_bytes;
  alignas(64) int32_t abort_claimed;  // the first abort() writes the reason; later ones keep it
  int32_t aborted;
  int64_t aborted_by;
  char reason[240];
  RankState ranks[kMaxRanks];
};
static_assert(sizeof(Header) <= kHeaderBytes, "the header must fit its pages");

template <typename T>
T load_acquire(const T* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

template <typename T>
void store_release(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

int64_t segment_bytes(int64_t world_size, int64_t slot_bytes) { return kHeaderBytes + 2 * world_size * slot_bytes; }

// A live process, as far as this host can tell: kill(pid, 0) fails with ESRCH once it is reaped, and until then
// an exited child is a zombie ('Z') in /proc/<pid>/stat. EPERM (another user's process) counts as alive.
bool alive(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(f, stat)) return true;  // no /proc: the signal test is all there is
  const size_t paren = stat.rfind(')');     // the command name may hold spaces and parentheses
  return paren == std::string::npos || paren + 2 >= stat.size() || (stat[paren + 2] != 'Z' && stat[paren + 2] != 'X');
}

struct Segment {
  Header* h;
  uint8_t* data;
  int64_t rank, world, slot_bytes;

  uint8_t* slot(uint64_t round, int64_t r) const {
    return data + (static_cast<int64_t>(round & 1) * world + r) * slot_bytes;
  }

  uint64_t next_round() const { return __atomic_load_n(&h->ranks[rank].round, __ATOMIC_RELAXED) + 1; }

  void check_abort() const {
    TORCH_CHECK(!load_acquire(&h->aborted), "tensor-parallel communicator aborted by rank ", h->aborted_by, ": ",
                std::string(h->reason, strnlen(h->reason, sizeof(h->reason))));
  }

  void check_peers() const {
    for (int64_t r = 0; r < world; ++r) {
      const int64_t pid = load_acquire(&h->ranks[r].pid);
      TORCH_CHECK(r == rank || pid == 0 || alive(pid), "tensor-parallel rank ", r, " (pid ", pid, ") exited");
    }
  }

  // Publishes this rank's slot for `round` and waits until every rank has published it.
  void publish_and_wait(uint64_t round) const {
    store_release(&h->ranks[rank].round, round);
    using clock = std::chrono::steady_clock;
    using std::chrono::microseconds;
    const auto start = clock::now();
    auto next_check = start + std::chrono::milliseconds(50);
    auto nap = microseconds(20);
    int64_t r = 0;  // ranks below r have published
    while (true) {
      check_abort();
      while (r < world && load_acquire(&h->ranks[r].round) >= round) ++r;
      if (r == world) return;
      const auto now = clock::now();
      if (now - start < microseconds(50)) {
        cpu_relax();
      } else if (now - start < microseconds(1000)) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(nap);
        nap = std::min(nap * 2, microseconds(1000));
      }
      if (now >= next_check) {
        check_peers();
        next_check = now + std::chrono::milliseconds(50);
      }
    }
  }
};

Segment open_segment(const at::Tensor& seg, int64_t rank) {
  TORCH_CHECK(seg.scalar_type() == at::kByte && seg.is_contiguous() && seg.numel() >= kHeaderBytes,
              "shm collectives: seg must be the communicator's uint8 segment");
  auto* h = reinterpret_cast<Header*>(seg.data_ptr<uint8_t>());
  TORCH_CHECK(load_acquire(&h->magic) == kMagic, "shm collectives: the segment was not initialized by rank 0");
  TORCH_CHECK(seg.numel() >= segment_bytes(h->world_size, h->slot_bytes), "shm collectives: the segment is truncated");
  TORCH_CHECK(0 <= rank && rank < h->world_size, "shm collectives: rank ", rank, " outside [0, ", h->world_size, ")");
  return {h, seg.data_ptr<uint8_t>() + kHeaderBytes, rank, h->world_size, h->slot_bytes};
}

// Rank 0 lays out the fresh (zeroed) segment; every rank then records its pid for the peers' liveness checks.
void shm_comm_register(at::Tensor& seg, int64_t rank, int64_t world_size, int64_t slot_bytes) {
  if (rank == 0) {
    TORCH_CHECK(1 <= world_size && world_size <= kMaxRanks, "shm collectives: 1 to ", kMaxRanks, " ranks");
    TORCH_CHECK(slot_bytes >= 64 && slot_bytes % 64 == 0, "shm collectives: slot_bytes: a positive multiple of 64");
    TORCH_CHECK(seg.scalar_type() == at::kByte && seg.is_contiguous() &&
                    seg.numel() >= segment_bytes(world_size, slot_bytes),
                "shm collectives: the segment must hold ", segment_bytes(world_size, slot_bytes), " bytes");
    auto* h = reinterpret_cast<Header*>(seg.data_ptr<uint8_t>());
    TORCH_CHECK(load_acquire(&h->magic) == 0, "shm collectives: the segment is already in use");
    h->world_size = world_size;
    h->slot_bytes = slot_bytes;
    store_release(&h->magic, kMagic);
  }
  const Segment s = open_segment(seg, rank);
  TORCH_CHECK(s.world == world_size && s.slot_bytes == slot_bytes, "shm collectives: rank 0 created the segment for ",
              s.world, " ranks of ", s.slot_bytes, " bytes, rank ", rank, " attaches for ", world_size, " of ",
              slot_bytes);
  int64_t none = 0;
  const int64_t pid = getpid();
  TORCH_CHECK(__atomic_compare_exchange_n(&s.h->ranks[rank].pid, &none, pid, false, __ATOMIC_ACQ_REL,
                                          __ATOMIC_ACQUIRE),
              "shm collectives: rank ", rank, " is already attached (pid ", none, ")");
}

void shm_comm_abort(at::Tensor& seg, int64_t rank, c10::string_view reason) {
  const Segment s = open_segment(seg, rank);
  int32_t free = 0;
  if (!__atomic_compare_exchange_n(&s.h->abort_claimed, &free, 1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return;
  const size_t n = std::min(reason.size(), sizeof(s.h->reason) - 1);
  std::memcpy(s.h->reason, reason.data(), n);
  s.h->reason[n] = '\0';
  s.h->aborted_by = rank;
  store_release(&s.h->aborted, 1);
}

// fp32 from and to the tensor's type, written so that the compiler vectorizes them: c10's scalar casts branch
// per value (bf16) or convert one value at a time (fp16). Rounding is torch's: to nearest even, NaN kept.
void widen(const float* x, float* y, int64_t m) { std::memcpy(y, x, m * sizeof(float)); }
void narrow(const float* y, float* x, int64_t m) { std::memcpy(x, y, m * sizeof(float)); }

void widen(const c10::BFloat16* x, float* y, int64_t m) {
  const auto* b = reinterpret_cast<const uint16_t*>(x);
  auto* u = reinterpret_cast<uint32_t*>(y);
  for (int64_t j = 0; j < m; ++j) u[j] = static_cast<uint32_t>(b[j]) << 16;
}

void narrow(const float* y, c10::BFloat16* x, int64_t m) {
  const auto* u = reinterpret_cast<const uint32_t*>(y);
  auto* b = reinterpret_cast<uint16_t*>(x);
  for (int64_t j = 0; j < m; ++j)
    b[j] = y[j] != y[j] ? uint16_t{0x7FC0} : static_cast<uint16_t>((u[j] + 0x7FFF + ((u[j] >> 16) & 1)) >> 16);
}

void widen(const c10::Half* x, float* y, int64_t m) {
  int64_t j = 0;
#if defined(__F16C__)
  for (; j + 8 <= m; j += 8)
    _mm256_storeu_ps(y + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + j))));
#endif
  for (; j < m; ++j) y[j] = static_cast<float>(x[j]);
}

void narrow(const float* y, c10::Half* x, int64_t m) {
  int64_t j = 0;
#if defined(__F16C__)
  for (; j + 8 <= m; j += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(y + j), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x + j), h);
  }
#endif
  for (; j < m; ++j) x[j] = static_cast<c10::Half>(y[j]);
}

// out[i] = round(sum over ranks 0..N-1, in that order, of slot_r[i] in fp32), block by block so the fp32
// partial sums stay in L1.
template <typename T>
void sum_slots(const Segment& s, uint64_t round, T* out, int64_t n) {
  constexpr int64_t kBlock = 1024;
  float acc[kBlock], x[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t m = std::min(kBlock, n - i0);
    widen(reinterpret_cast<const T*>(s.slot(round, 0)) + i0, acc, m);
    for (int64_t r = 1; r < s.world; ++r) {
      widen(reinterpret_cast<const T*>(s.slot(round, r)) + i0, x, m);
      for (int64_t j = 0; j < m; ++j) acc[j] += x[j];
    }
    narrow(acc, out + i0, m);
  }
}

template <typename T>
void all_reduce(const Segment& s, T* p, int64_t n) {
  const int64_t chunk = s.slot_bytes / static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < n; off += chunk) {
    const int64_t len = std::min(chunk, n - off);
    const uint64_t round = s.next_round();
    std::memcpy(s.slot(round, s.rank), p + off, len * sizeof(T));
    s.publish_and_wait(round);
    sum_slots(s, round, p + off, len);
  }
}

void shm_all_reduce(at::Tensor& seg, int64_t rank, at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "shm all_reduce: t must be contiguous");
  const Segment s = open_segment(seg, rank);
  switch (t.scalar_type()) {
    case at::kFloat: return all_reduce(s, t.data_ptr<float>(), t.numel());
    case at::kBFloat16: return all_reduce(s, t.data_ptr<c10::BFloat16>(), t.numel());
    case at::kHalf: return all_reduce(s, t.data_ptr<c10::Half>(), t.numel());
    default: TORCH_CHECK(false, "shm all_reduce: fp32, bf16 or fp16, not ", t.scalar_type());
  }
}

// out[r] = rank r's t, for tensors of the same size on every rank.
void shm_all_gather(at::Tensor& seg, int64_t rank, const at::Tensor& t, at::Tensor& out) {
  const Segment s = open_segment(seg, rank);
  TORCH_CHECK(t.is_contiguous() && out.is_contiguous() && t.scalar_type() == out.scalar_type() &&
                  out.numel() == s.world * t.numel(),
              "shm all_gather: t and out [world_size, *t.shape] must be contiguous, of one dtype");
  const auto* src = static_cast<const uint8_t*>(t.const_data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  const int64_t nbytes = t.nbytes();
  for (int64_t off = 0; off < nbytes; off += s.slot_bytes) {
    const int64_t len = std::min(s.slot_bytes, nbytes - off);
    const uint64_t round = s.next_round();
    std::memcpy(s.slot(round, s.rank), src + off, len);
    s.publish_and_wait(round);
    for (int64_t r = 0; r < s.world; ++r) std::memcpy(dst + r * nbytes + off, s.slot(round, r), len);
  }
}

// Rank 0's bytes on the other ranks (rank 0, which passes them, gets an empty tensor; the others pass None). The
// first round carries the length ahead of the first chunk, so a payload of any size goes through the fixed slots.
at::Tensor shm_broadcast_bytes(at::Tensor& seg, int64_t rank, const c10::optional<at::Tensor>& data) {
  const Segment s = open_segment(seg, rank);
  TORCH_CHECK(data.has_value() == (rank == 0), "shm broadcast: rank 0 passes the bytes, the other ranks None");
  const at::Tensor src = data.value_or(at::Tensor());
  TORCH_CHECK(rank != 0 || (src.scalar_type() == at::kByte && src.dim() == 1 && src.is_contiguous()),
              "shm broadcast: the bytes must be a 1-D contiguous uint8 tensor");
  at::Tensor out = at::empty({0}, at::kByte);
  int64_t total = rank == 0 ? src.numel() : 0, off = 0;
  constexpr int64_t kLen = sizeof(int64_t);
  for (bool first = true; first || off < total; first = false) {
    const int64_t head = first ? kLen : 0;
    const uint64_t round = s.next_round();
    uint8_t* root = s.slot(round, 0);
    if (rank == 0) {
      if (first) std::memcpy(root, &total, kLen);
      std::memcpy(root + head, src.const_data_ptr<uint8_t>() + off, std::min(s.slot_bytes - head, total - off));
    }
    s.publish_and_wait(round);
    if (rank != 0 && first) {
      std::memcpy(&total, root, kLen);
      out = at::empty({total}, at::kByte);
    }
    const int64_t len = std::min(s.slot_bytes - head, total - off);
    if (rank != 0) std::memcpy(out.data_ptr<uint8_t>() + off, root + head, len);
    off += len;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("shm_comm_segment_bytes(int world_size, int slot_bytes) -> int", &segment_bytes);  // no tensors: no dispatch
  m.def("shm_comm_register(Tensor(a!) seg, int rank, int world_size, int slot_bytes) -> ()");
  m.def("shm_comm_abort(Tensor(a!) seg, int rank, str reason) -> ()");
  m.def("shm_all_reduce(Tensor(a!) seg, int rank, Tensor(b!) t) -> ()");
  m.def("shm_all_gather(Tensor(a!) seg, int rank, Tensor t, Tensor(b!) out) -> ()");
  m.def("shm_broadcast_bytes(Tensor(a!) seg, int rank, Tensor? data) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("shm_comm_register", &shm_comm_register);
  m.impl("shm_comm_abort", &shm_comm_abort);
  m.impl("shm_all_reduce", &shm_all_reduce);
  m.impl("shm_all_gather", &shm_all_gather);
  m.impl("shm_broadcast_bytes", &shm_broadcast_bytes);
}

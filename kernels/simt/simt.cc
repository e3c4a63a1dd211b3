// The fibers behind simt.h. A block's fibers share the calling thread,
// so nothing here needs a lock: one fiber runs at a time, and it gives
// the thread back only where it waits (Yield).
//
// A fiber starts on its own stack through makecontext and setcontext;
// after that, switches are _setjmp / _longjmp, which do not save the
// signal mask: swapcontext makes a system call per switch, and an MMA
// takes four switches per lane. glibc's fortified longjmp refuses a jump
// to another stack ("uninitialized stack frame"), hence the #undef.
#undef _FORTIFY_SOURCE
#include <setjmp.h>
#include <ucontext.h>

#include "kernels/simt/simt.h"

#ifdef MUSTER_SIMT_TSAN
#include <sanitizer/tsan_interface.h>
#endif
#ifdef MUSTER_SIMT_ASAN
#include <dlfcn.h>
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <random>
#include <vector>

namespace muster::simt {
namespace {

constexpr int kWarpSize = 32;
constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kMaxDynamicShared = 228 * 1024;

// The race checker (built with MUSTER_SIMT_TSAN; simt.h says what it
// orders and reports). This file itself is not instrumented, as its
// bookkeeping is one thread's: these calls tell ThreadSanitizer which
// fiber runs, what the barriers order, and what the emulated memory
// instructions read and write.
namespace race {
#ifdef MUSTER_SIMT_TSAN
extern "C" void __tsan_read_range(void* address, unsigned long bytes);
extern "C" void __tsan_write_range(void* address, unsigned long bytes);
constexpr bool kOn = true;
void* Current() { return __tsan_get_current_fiber(); }
void* Create() { return __tsan_create_fiber(0); }
void Destroy(void* fiber) { __tsan_destroy_fiber(fiber); }
void Name(void* fiber, const char* name) { __tsan_set_fiber_name(fiber, name); }
// `ordered`: what the switching context did happens before what the
// fiber does next.
void SwitchTo(void* fiber, bool ordered) {
  __tsan_switch_to_fiber(fiber, ordered ? 0 : __tsan_switch_to_fiber_no_sync);
}
void Release(const void* sync) { __tsan_release(const_cast<void*>(sync)); }
void Acquire(const void* sync) { __tsan_acquire(const_cast<void*>(sync)); }
void Read(const void* address, size_t bytes) {
  __tsan_read_range(const_cast<void*>(address), bytes);
}
void Write(void* address, size_t bytes) { __tsan_write_range(address, bytes); }
#else
constexpr bool kOn = false;
void* Current() { return nullptr; }
void* Create() { return nullptr; }
void Destroy(void*) {}
void Name(void*, const char*) {}
void SwitchTo(void*, bool) {}
void Release(const void*) {}
void Acquire(const void*) {}
void Read(const void*, size_t) {}
void Write(void*, size_t) {}
#endif
}  // namespace race

// The memory checker (built with MUSTER_SIMT_ASAN, in binaries whose
// kernels are compiled and linked with -fsanitize=address; simt.h): told
// each time execution moves to another fiber's stack, AddressSanitizer
// keeps the stacks apart instead of taking a fiber's frames for the
// thread's. Leave before a switch (saving the leaving fiber's fake stack,
// or nullptr when it ends), Arrive after it (which can also give the
// bounds of the stack left).
namespace stacks {
#ifdef MUSTER_SIMT_ASAN
void Leave(void** fake_stack, const void* bottom, size_t size) {
  __sanitizer_start_switch_fiber(fake_stack, bottom, size);
}
void Arrive(void* fake_stack, const void** bottom_left, size_t* size_left) {
  __sanitizer_finish_switch_fiber(fake_stack, bottom_left, size_left);
}
#else
void Leave(void**, const void*, size_t) {}
void Arrive(void*, const void**, size_t*) {}
#endif
}  // namespace stacks

struct Copy {
  void* dst;
  const void* src;
  int src_bytes;
};

// A barrier of `parties`: the last to arrive starts a new generation,
// which lets the others go on.
struct Barrier {
  int arrived = 0;
  uint64_t generation = 0;
  // The race checker's synchronisation objects, one per generation
  // parity: a fiber leaving generation g acquires what generation g's
  // arrivals released, never what a fiber that went on already released
  // at g + 1 (arriving at g + 2 needs every party past g).
  char sync[2];
};

struct Fiber {
  ucontext_t context;  // to start it
  jmp_buf resume;      // where it yielded
  bool started = false;
  std::unique_ptr<char[]> stack;
  void* tsan = nullptr;        // its ThreadSanitizer fiber (race::kOn)
  void* fake_stack = nullptr;  // AddressSanitizer's, while it waits (stacks)
  uint3 index;
  bool done = false;
  // While waiting: the barrier, its generation when this fiber arrived
  // (the scheduler resumes the fiber only once that has moved), and the
  // instruction waited at.
  const Barrier* barrier = nullptr;
  const char* op = "";
  uint64_t generation = 0;
  std::vector<Copy> open_group;
  std::deque<std::vector<Copy>> committed;
};

// What the lanes of a warp hand each other in one warp-wide instruction.
struct WarpSlot {
  Barrier barrier;
  uint32_t words[kWarpSize][8];
  const void* pointers[kWarpSize];
  double product[16][8];  // an MMA's A B, computed once for the warp
};

struct Block {
  dim3 grid, block;
  uint3 block_index;
  std::vector<Fiber> fibers;
  std::vector<WarpSlot> warps;
  Barrier block_barrier;
  int live = 0;
  int current = -1;
  jmp_buf scheduler;
  void* scheduler_tsan = nullptr;  // the launching thread's (race::kOn)
  // The launching thread's stack, and its fake stack while a fiber runs
  // (stacks).
  const void* scheduler_stack = nullptr;
  size_t scheduler_stack_bytes = 0;
  void* scheduler_fake_stack = nullptr;
  char done_sync;  // the block's fibers release it as they end
  std::vector<unsigned char> dynamic_shared;
  const std::function<void()>* kernel = nullptr;
};

Block* g_block = nullptr;  // the block being run
int g_last_error = 0;
std::string g_last_message;
// The schedule a process starts with: round robin, or what
// MUSTER_SIMT_SCHEDULE names, so a whole test binary can run under another
// (scripts/test.sh runs fast_simt_test under lowest_first and
// highest_first too). The seed of `shuffled` is 1.
Schedule ScheduleFromEnvironment() {
  const char* name = std::getenv("MUSTER_SIMT_SCHEDULE");
  if (name == nullptr || std::strcmp(name, "round_robin") == 0) return Schedule::kRoundRobin;
  if (std::strcmp(name, "shuffled") == 0) return Schedule::kShuffled;
  if (std::strcmp(name, "lowest_first") == 0) return Schedule::kLowestFirst;
  if (std::strcmp(name, "highest_first") == 0) return Schedule::kHighestFirst;
  std::fprintf(stderr,
               "simt: MUSTER_SIMT_SCHEDULE=%s: expected round_robin, shuffled, lowest_first or "
               "highest_first\n",
               name);
  std::exit(2);
}

Schedule g_schedule = ScheduleFromEnvironment();
uint64_t g_seed = 1;
Counters g_counters;

#ifdef MUSTER_SIMT_ASAN
// AddressSanitizer knows one thread; this names the CUDA thread that made
// the access it reports.
void NameCudaThread(const char*) {
  if (g_block == nullptr || g_block->current < 0) return;
  const uint3& t = g_block->fibers[g_block->current].index;
  const uint3& b = g_block->block_index;
  std::fprintf(stderr, "simt: made by CUDA thread (%u, %u, %u) of block (%u, %u, %u)\n", t.x, t.y,
               t.z, b.x, b.y, b.z);
}
#endif

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "simt: %s\n", what);
  std::abort();
}

// Switches to the context saved in `to`. Built for the memory checker,
// through libc's _longjmp itself: AddressSanitizer's makes a system call
// (sigaltstack) on every jump to clean up the stack it leaves, which made
// the emulation ten times slower, and the fibers tell it about their
// stacks themselves (stacks:: above).
[[noreturn]] void Jump(jmp_buf to) {
#ifdef MUSTER_SIMT_ASAN
  using LongJmp = void (*)(jmp_buf, int);
  static const LongJmp libc_longjmp = [] {
    void* libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
    void* symbol = libc != nullptr ? dlsym(libc, "_longjmp") : nullptr;
    if (symbol == nullptr) Fail("cannot find libc's _longjmp");
    return reinterpret_cast<LongJmp>(symbol);
  }();
  libc_longjmp(to, 1);
  __builtin_unreachable();
#else
  _longjmp(to, 1);
#endif
}

Fiber& Current() {
  if (g_block == nullptr || g_block->current < 0)
    Fail("a device function was called outside a kernel");
  return g_block->fibers[g_block->current];
}

// Switches from the running fiber to the scheduler, telling the checkers;
// `fake_stack` keeps AddressSanitizer's for the fiber's return (nullptr:
// the fiber has ended).
[[noreturn]] void ToScheduler(void** fake_stack) {
  race::SwitchTo(g_block->scheduler_tsan, false);
  stacks::Leave(fake_stack, g_block->scheduler_stack, g_block->scheduler_stack_bytes);
  Jump(g_block->scheduler);
}

// Hands the thread back to the scheduler until it resumes this fiber.
void Yield() {
  Fiber& fiber = Current();
  if (_setjmp(fiber.resume) == 0) ToScheduler(&fiber.fake_stack);
  stacks::Arrive(fiber.fake_stack, nullptr, nullptr);
}

// Arrives at `barrier` of `parties` and waits for the rest. Returns true
// for the last to arrive, which goes on before any other: the others
// resume only when it next yields. `orders_memory`: the barrier orders
// memory for the race checker (__syncthreads and __syncwarp do; the
// waits inside shfl, vote, ldmatrix and mma.sync do not).
bool Wait(Barrier& barrier, int parties, const char* op, bool orders_memory) {
  Fiber& fiber = Current();
  ++g_counters.barriers;
  const uint64_t generation = barrier.generation;
  const char* sync = &barrier.sync[generation & 1];
  if (orders_memory) race::Release(sync);
  if (++barrier.arrived >= parties) {
    barrier.arrived = 0;
    ++barrier.generation;
    if (orders_memory) race::Acquire(sync);
    return true;
  }
  fiber.barrier = &barrier;
  fiber.generation = generation;
  fiber.op = op;
  while (barrier.generation == generation) Yield();
  Current().barrier = nullptr;
  if (orders_memory) race::Acquire(sync);
  return false;
}

void ReleaseBlockBarrierIfAllArrived(Block& block) {
  Barrier& barrier = block.block_barrier;
  if (barrier.arrived > 0 && barrier.arrived >= block.live) {
    barrier.arrived = 0;
    ++barrier.generation;
  }
}

// The fiber's thread number in its block (x fastest), as CUDA numbers
// lanes and warps.
int LinearIndex(const Fiber& fiber) {
  const dim3& block = g_block->block;
  return fiber.index.x + block.x * (fiber.index.y + block.y * fiber.index.z);
}
int LaneOf(const Fiber& fiber) { return LinearIndex(fiber) % kWarpSize; }
WarpSlot& WarpOf(const Fiber& fiber) { return g_block->warps[LinearIndex(fiber) / kWarpSize]; }

// One warp-wide instruction: every lane stores its inputs (`store`), all
// wait for each other, the last to arrive runs `once` for the warp, each
// lane computes its outputs from the slot (`load`), and all wait again
// before the slot can be reused.
template <typename Store, typename Once, typename Load>
void WarpExchange(const char* op, Store store, Once once, Load load) {
  Fiber& fiber = Current();
  WarpSlot& slot = WarpOf(fiber);
  const int lane = LaneOf(fiber);
  store(slot, lane);
  if (Wait(slot.barrier, kWarpSize, op, false)) once(slot);
  load(slot, lane);
  Wait(slot.barrier, kWarpSize, op, false);
}
void Nothing(WarpSlot&) {}

void RunFiber() {
  Block& block = *g_block;
  stacks::Arrive(nullptr, &block.scheduler_stack, &block.scheduler_stack_bytes);
  (*block.kernel)();
  Fiber& fiber = Current();
  // Copies never waited for are dropped: the kernel never looked at them.
  fiber.done = true;
  --block.live;
  ReleaseBlockBarrierIfAllArrived(block);
  race::Release(&block.done_sync);
  ToScheduler(nullptr);
}

float FloatOf(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}
// A bf16 is the top half of the float with the same value.
float Bf16Low(uint32_t word) { return FloatOf(word << 16); }
float Bf16High(uint32_t word) { return FloatOf(word & 0xffff0000u); }

float Tf32(uint32_t word) { return FloatOf(word & 0xffffe000u); }

// product (16 x 8) = A (16 x k, row-major) B (k x 8, row-major), in double.
void Multiply(const float* A, const float* B, int k, double (*product)[8]) {
  for (int row = 0; row < 16; ++row)
    for (int col = 0; col < 8; ++col) {
      double sum = 0;
      for (int i = 0; i < k; ++i) sum += static_cast<double>(A[row * k + i]) * B[i * 8 + col];
      product[row][col] = sum;
    }
}

// A lane's accumulators c[0..3] += the warp's product, rounded once.
void AddProduct(const WarpSlot& slot, int lane, float* c) {
  const int g = lane / 4, q = lane % 4;
  for (int e = 0; e < 4; ++e) {
    c[e] = static_cast<float>(c[e] + slot.product[g + 8 * (e >> 1)][2 * q + (e & 1)]);
  }
}

std::string DescribeDeadlock(const Block& block) {
  std::string text = "deadlock in block (" + std::to_string(block.block_index.x) + ", " +
                     std::to_string(block.block_index.y) + ", " +
                     std::to_string(block.block_index.z) + "):";
  int shown = 0;
  for (const Fiber& fiber : block.fibers) {
    if (fiber.done || shown == 8) continue;
    ++shown;
    text += " thread " + std::to_string(LinearIndex(fiber)) + " at " + fiber.op + ";";
  }
  const int exited = static_cast<int>(block.fibers.size()) - block.live;
  text += " " + std::to_string(exited) + " threads had exited";
  return text;
}

bool Runnable(const Fiber& fiber) {
  return !fiber.done && (fiber.barrier == nullptr || fiber.barrier->generation != fiber.generation);
}

// Runs fiber i until it next yields or ends.
void Resume(Block& block, int i) {
  block.current = i;
  if (_setjmp(block.scheduler) == 0) {
    Fiber& fiber = block.fibers[i];
    // A fiber's first run in a block starts after everything the
    // launching thread did (and, through it, every block before).
    race::SwitchTo(fiber.tsan, !fiber.started);
    stacks::Leave(&block.scheduler_fake_stack, fiber.stack.get(), kStackBytes);
    if (!fiber.started) {
      fiber.started = true;
      setcontext(&fiber.context);
    }
    Jump(fiber.resume);
  }
  stacks::Arrive(block.scheduler_fake_stack, nullptr, nullptr);
  block.current = -1;
}

// Runs one block to its end; false on a deadlock (g_last_message says).
bool RunBlock(Block& block, Schedule schedule, std::mt19937_64& shuffle) {
  const int threads = static_cast<int>(block.fibers.size());
  for (int i = 0; i < threads; ++i) {
    Fiber& fiber = block.fibers[i];
    fiber.done = false;
    fiber.started = false;
    fiber.barrier = nullptr;
    fiber.open_group.clear();
    fiber.committed.clear();
    getcontext(&fiber.context);
    fiber.context.uc_stack.ss_sp = fiber.stack.get();
    fiber.context.uc_stack.ss_size = kStackBytes;
    fiber.context.uc_link = nullptr;
    makecontext(&fiber.context, RunFiber, 0);
    if (race::kOn) {
      const std::string name = "CUDA thread " + std::to_string(i) + " of block (" +
                               std::to_string(block.block_index.x) + ", " +
                               std::to_string(block.block_index.y) + ", " +
                               std::to_string(block.block_index.z) + ")";
      race::Name(fiber.tsan, name.c_str());
    }
  }
  block.live = threads;
  block.block_barrier = Barrier{};
  for (WarpSlot& slot : block.warps) slot.barrier = Barrier{};
  std::fill(block.dynamic_shared.begin(), block.dynamic_shared.end(), 0xff);
  std::vector<int> order(threads);
  for (int i = 0; i < threads; ++i) {
    order[i] = schedule == Schedule::kHighestFirst ? threads - 1 - i : i;
  }
  const bool greedy = schedule == Schedule::kLowestFirst || schedule == Schedule::kHighestFirst;
  while (block.live > 0) {
    if (schedule == Schedule::kShuffled) std::shuffle(order.begin(), order.end(), shuffle);
    bool any = false;
    for (int i : order) {
      if (!Runnable(block.fibers[i])) continue;
      any = true;
      Resume(block, i);
      if (greedy) break;  // from the first in order again
    }
    if (!any) {
      g_last_message = DescribeDeadlock(block);
      return false;
    }
  }
  race::Acquire(&block.done_sync);
  return true;
}

}  // namespace

const uint3& ThreadIdx() { return Current().index; }
const uint3& BlockIdx() {
  Current();
  return g_block->block_index;
}
const dim3& BlockDim() {
  Current();
  return g_block->block;
}
const dim3& GridDim() {
  Current();
  return g_block->grid;
}

void SyncThreads() {
  Current();
  Wait(g_block->block_barrier, g_block->live, "__syncthreads", true);
}

void SyncWarp() {
  Fiber& fiber = Current();
  Wait(WarpOf(fiber).barrier, kWarpSize, "__syncwarp", true);
}

uint32_t ShflXor32(uint32_t value, int lane_mask) {
  uint32_t result = 0;
  WarpExchange(
      "shfl.xor", [&](WarpSlot& slot, int lane) { slot.words[lane][0] = value; }, Nothing,
      [&](WarpSlot& slot, int lane) { result = slot.words[(lane ^ lane_mask) % kWarpSize][0]; });
  return result;
}

bool AnySync(bool predicate) {
  bool any = false;
  WarpExchange(
      "vote.any", [&](WarpSlot& slot, int lane) { slot.words[lane][0] = predicate ? 1 : 0; },
      Nothing,
      [&](WarpSlot& slot, int) {
        for (int lane = 0; lane < kWarpSize; ++lane) any = any || slot.words[lane][0] != 0;
      });
  return any;
}

// One mma.sync: every lane hands in its A and B fragments; `unpack`
// rebuilds A (16 x k) and B (k x 8) from all 32 lanes' words for the
// warp, which multiplies them once; each lane adds its part to c.
template <int k, typename Unpack>
void Mma(const char* op, float* c, const uint32_t* a, uint32_t b0, uint32_t b1, Unpack unpack) {
  ++g_counters.mma;
  WarpExchange(
      op,
      [&](WarpSlot& slot, int lane) {
        for (int i = 0; i < 4; ++i) slot.words[lane][i] = a[i];
        slot.words[lane][4] = b0;
        slot.words[lane][5] = b1;
      },
      [&](WarpSlot& slot) {
        float A[16][k], B[k][8];
        for (int l = 0; l < kWarpSize; ++l) unpack(slot.words[l], l / 4, l % 4, A, B);
        Multiply(&A[0][0], &B[0][0], k, slot.product);
      },
      [&](WarpSlot& slot, int lane) { AddProduct(slot, lane, c); });
}

void MmaBf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  Mma<16>(
      "mma.m16n8k16.bf16", c, a, b0, b1,
      [](const uint32_t* w, int g, int q, float(*A)[16], float(*B)[8]) {
        const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * q, 2 * q, 2 * q + 8, 2 * q + 8};
        for (int i = 0; i < 4; ++i) {
          A[rows[i]][cols[i]] = Bf16Low(w[i]);
          A[rows[i]][cols[i] + 1] = Bf16High(w[i]);
        }
        B[2 * q][g] = Bf16Low(w[4]);
        B[2 * q + 1][g] = Bf16High(w[4]);
        B[2 * q + 8][g] = Bf16Low(w[5]);
        B[2 * q + 9][g] = Bf16High(w[5]);
      });
}

void MmaTf32(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  Mma<8>("mma.m16n8k8.tf32", c, a, b0, b1,
         [](const uint32_t* w, int g, int q, float(*A)[8], float(*B)[8]) {
           A[g][q] = Tf32(w[0]);
           A[g + 8][q] = Tf32(w[1]);
           A[g][q + 4] = Tf32(w[2]);
           A[g + 8][q + 4] = Tf32(w[3]);
           B[q][g] = Tf32(w[4]);
           B[q + 4][g] = Tf32(w[5]);
         });
}

void LdMatrixX4(const void* row, uint32_t* r, bool trans) {
  WarpExchange(
      trans ? "ldmatrix.x4.trans" : "ldmatrix.x4",
      [&](WarpSlot& slot, int lane) {
        race::Read(row, 16);  // the row this lane names
        slot.pointers[lane] = row;
      },
      Nothing,
      [&](WarpSlot& slot, int lane) {
        auto element = [&](int matrix, int i, int j) {  // matrix's (row i, column j)
          uint16_t value;
          std::memcpy(&value, static_cast<const uint16_t*>(slot.pointers[8 * matrix + i]) + j, 2);
          return static_cast<uint32_t>(value);
        };
        const int g = lane / 4, q = lane % 4;
        for (int matrix = 0; matrix < 4; ++matrix) {
          if (trans) {
            r[matrix] = element(matrix, 2 * q, g) | element(matrix, 2 * q + 1, g) << 16;
          } else {
            r[matrix] = element(matrix, g, 2 * q) | element(matrix, g, 2 * q + 1) << 16;
          }
        }
      });
}

void CpAsync16(void* dst, const void* src, int src_bytes) {
  if (src_bytes != 0 && src_bytes != 16) Fail("cp.async with a source size other than 0 or 16");
  if (src_bytes > 0) race::Read(src, src_bytes);
  race::Write(dst, 16);
  // Until the copy completes, what a reader finds there is NaN.
  std::memset(dst, 0xff, 16);
  Current().open_group.push_back(Copy{dst, src, src_bytes});
}

void CpAsyncCommit() {
  Fiber& fiber = Current();
  fiber.committed.push_back(std::move(fiber.open_group));
  fiber.open_group.clear();
}

void CpAsyncWait(int pending) {
  Fiber& fiber = Current();
  while (static_cast<int>(fiber.committed.size()) > pending) {
    for (const Copy& copy : fiber.committed.front()) {
      race::Write(copy.dst, 16);
      std::memset(copy.dst, 0, 16);
      if (copy.src_bytes > 0) std::memcpy(copy.dst, copy.src, copy.src_bytes);
    }
    fiber.committed.pop_front();
  }
}

unsigned char* DynamicShared() {
  Current();
  return g_block->dynamic_shared.data();
}

int Launch(dim3 grid, dim3 block_dim, size_t dynamic_shared_bytes,
           const std::function<void()>& kernel) {
  const int threads = static_cast<int>(block_dim.x * block_dim.y * block_dim.z);
  if (threads <= 0 || threads > 1024 || threads % kWarpSize != 0 ||
      dynamic_shared_bytes > kMaxDynamicShared || grid.x == 0 || grid.y == 0 || grid.z == 0) {
    g_last_error = static_cast<int>(cudaErrorInvalidConfiguration);
    g_last_message = "launch: bad grid, block or shared memory size";
    return g_last_error;
  }
  if (g_block != nullptr) Fail("a kernel launched from inside a kernel");
#ifdef MUSTER_SIMT_ASAN
  __asan_set_error_report_callback(NameCudaThread);
#endif
  Block block;
  block.grid = grid;
  block.block = block_dim;
  block.kernel = &kernel;
  block.fibers.resize(threads);
  block.warps.resize(threads / kWarpSize);
  block.dynamic_shared.assign(dynamic_shared_bytes, 0xff);
  for (int i = 0; i < threads; ++i) {
    Fiber& fiber = block.fibers[i];
    fiber.stack.reset(new char[kStackBytes]);
    fiber.tsan = race::Create();
    fiber.index = uint3{static_cast<unsigned>(i % block_dim.x),
                        static_cast<unsigned>(i / block_dim.x % block_dim.y),
                        static_cast<unsigned>(i / (block_dim.x * block_dim.y))};
  }
  block.scheduler_tsan = race::Current();
  std::mt19937_64 shuffle(g_seed);
  const Schedule schedule = g_schedule;
  g_block = &block;
  bool ok = true;
  for (unsigned z = 0; z < grid.z && ok; ++z)
    for (unsigned y = 0; y < grid.y && ok; ++y)
      for (unsigned x = 0; x < grid.x && ok; ++x) {
        block.block_index = uint3{x, y, z};
        ok = RunBlock(block, schedule, shuffle);
        ++g_counters.blocks;
      }
  g_block = nullptr;
  for (Fiber& fiber : block.fibers) race::Destroy(fiber.tsan);
  if (!ok) {
    g_last_error = static_cast<int>(cudaErrorLaunchFailure);
    return g_last_error;
  }
  return 0;
}

int LastError() {
  const int error = g_last_error;
  g_last_error = 0;
  return error;
}

std::string LastErrorMessage() { return g_last_message; }

void SetSchedule(Schedule schedule, uint64_t seed) {
  g_schedule = schedule;
  g_seed = seed;
}

Counters GetCounters() { return g_counters; }

// The runtime calls: simt.h's macros stand for the real ones here too.
cudaError_t Malloc(void** pointer, size_t bytes) {
#ifdef MUSTER_SIMT_ASAN
  // Exactly `bytes`, so that the memory checker reports an access past
  // the end.
  if (posix_memalign(pointer, 256, bytes > 0 ? bytes : 1) != 0) *pointer = nullptr;
#else
  *pointer = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
#endif
  return *pointer == nullptr ? cudaErrorMemoryAllocation : cudaSuccess;
}
cudaError_t Free(void* pointer) {
  std::free(pointer);
  return cudaSuccess;
}
cudaError_t Memcpy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t Memset(void* pointer, int value, size_t bytes) {
  if (bytes > 0) std::memset(pointer, value, bytes);
  return cudaSuccess;
}
cudaError_t Synchronize() { return static_cast<cudaError_t>(LastError()); }
cudaError_t GetLastError() { return static_cast<cudaError_t>(LastError()); }

}  // namespace muster::simt

#ifdef MUSTER_SIMT_TSAN
// ThreadSanitizer calls this for every report it prints.
extern "C" void __tsan_on_report(void*) { ++muster::simt::g_counters.races; }
#endif

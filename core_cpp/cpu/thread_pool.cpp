#include "thread_pool.h"

#include <chrono>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <utility>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TINYVLLM_PAUSE() _mm_pause()
#else
#define TINYVLLM_PAUSE() std::this_thread::yield()
#endif

namespace tinyvllm::cpu {
namespace {

constexpr auto kSpin = std::chrono::microseconds(200);  // a decode step's gap between projections
constexpr int kPauseSpins = 2000;  // a few microseconds of pure spinning before yielding

std::mutex g_pool_mutex;
std::unique_ptr<ThreadPool> g_pool;

}  // namespace

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads) {
  for (int w = 1; w < num_threads_; ++w) threads_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::work_chunks() {
  const int64_t num_chunks = (num_items_ + grain_ - 1) / grain_;
  for (int64_t c = next_chunk_.fetch_add(1, std::memory_order_relaxed); c < num_chunks;
       c = next_chunk_.fetch_add(1, std::memory_order_relaxed)) {
    const int64_t begin = c * grain_;
    (*job_)(begin, begin + grain_ < num_items_ ? begin + grain_ : num_items_);
  }
}

void ThreadPool::run(int64_t num_items, int64_t grain, const RangeFn& fn) {
  if (num_items <= 0) return;
  grain = grain < 1 ? 1 : grain;
  if (num_threads_ == 1 || num_items <= grain) return fn(0, num_items);
  job_ = &fn;
  num_items_ = num_items;
  grain_ = grain;
  next_chunk_.store(0, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mutex_);  // pairs with the sleepers' predicate check
    state_.store(kOpen, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  work_chunks();
  // Close the job: no worker joins from here on; wait for those inside to finish their chunk.
  state_.fetch_and(~kOpen, std::memory_order_acq_rel);
  wait([&] { return state_.load(std::memory_order_acquire) == 0; }, done_);
  job_ = nullptr;
}

// Spin (polling `ready`), yielding the core once the first short burst has passed: on a quiet
// machine the wait ends within microseconds and no wake-up is paid; on a crowded one the yield
// lets the thread being waited for run. After kSpin, sleep on `cv` until notified.
template <typename Ready>
void ThreadPool::wait(Ready ready, std::condition_variable& cv) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  for (int spins = 1; !ready(); ++spins) {
    if (spins < kPauseSpins) {
      TINYVLLM_PAUSE();
      continue;
    }
    std::this_thread::yield();
    if (spins % 16 == 0 && std::chrono::steady_clock::now() > until) {
      std::unique_lock<std::mutex> lock(mutex_);
      cv.wait(lock, ready);
      return;
    }
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    wait([&] { return generation_.load(std::memory_order_acquire) != seen; }, wake_);
    if (stop_.load()) return;
    seen = generation_.load(std::memory_order_acquire);
    // Join only an open job: the job's fields are read after joining, and the caller changes
    // them only once every joined worker has left.
    uint32_t s = state_.load(std::memory_order_acquire);
    while ((s & kOpen) && !state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
    }
    if (!(s & kOpen)) continue;
    work_chunks();
    if (state_.fetch_sub(1, std::memory_order_acq_rel) == 1) {  // closed and now empty
      std::lock_guard<std::mutex> lock(mutex_);  // the caller may be asleep in wait()
      done_.notify_one();
    }
  }
}

int physical_cores() {
  // Distinct (physical id, core id) pairs; SMT siblings share one. Falls back to the logical count.
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::set<std::pair<std::string, std::string>> cores;
  std::string line, package = "0";
  while (std::getline(cpuinfo, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if (line.rfind("physical id", 0) == 0) package = value;
    if (line.rfind("core id", 0) == 0) cores.emplace(package, value);
  }
  const int logical = static_cast<int>(std::thread::hardware_concurrency());
  return cores.empty() ? (logical > 0 ? logical : 1) : static_cast<int>(cores.size());
}

ThreadPool& pool() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (!g_pool) g_pool = std::make_unique<ThreadPool>(physical_cores());
  return *g_pool;
}

void set_num_threads(int num_threads) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  g_pool.reset();
  g_pool = std::make_unique<ThreadPool>(num_threads > 0 ? num_threads : physical_cores());
}

}  // namespace tinyvllm::cpu

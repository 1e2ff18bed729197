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
  for (int w = 1; w < num_threads_; ++w) threads_.emplace_back([this, w] { worker_loop(w); });
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

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  if (num_threads_ == 1) return fn(0, 1);
  job_ = &fn;
  pending_.store(num_threads_ - 1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mutex_);  // pairs with the sleepers' predicate check
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  fn(0, num_threads_);
  wait([&] { return pending_.load(std::memory_order_acquire) == 0; }, done_);
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

bool ThreadPool::wait_for_job(uint64_t seen) {
  wait([&] { return generation_.load(std::memory_order_acquire) != seen; }, wake_);
  return !stop_.load();
}

void ThreadPool::worker_loop(int worker) {
  uint64_t seen = 0;
  while (wait_for_job(seen)) {
    seen = generation_.load(std::memory_order_acquire);
    (*job_)(worker, num_threads_);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
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

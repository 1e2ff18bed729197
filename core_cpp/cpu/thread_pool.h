// One persistent pool of std::threads for the CPU kernels. The caller is worker 0: a pool of n
// threads starts n - 1. A job is a range of items handed out in chunks from a shared counter:
// the caller and every worker that wakes while the job is open claim chunks until none are left,
// so a worker the OS has not scheduled in time (a busy machine) leaves its share to the others
// instead of stalling the step. Between jobs a worker spins briefly (the next projection usually
// follows within microseconds), yielding its core to anyone runnable, then sleeps on a condition
// variable, so an idle engine costs no CPU.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tinyvllm::cpu {

class ThreadPool {
 public:
  using RangeFn = std::function<void(int64_t begin, int64_t end)>;

  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }
  // Calls fn(begin, end) over [0, num_items) in chunks of `grain` items (the last one shorter),
  // each chunk exactly once, on the caller and whichever workers join; returns when all are
  // done. Not reentrant: one job at a time (callers hold kernel_mutex(), see linear.cpp).
  void run(int64_t num_items, int64_t grain, const RangeFn& fn);

 private:
  static constexpr uint32_t kOpen = 1u << 30;  // in state_: the job takes new participants

  void worker_loop();
  void work_chunks();
  template <typename Ready>
  void wait(Ready ready, std::condition_variable& cv);

  int num_threads_;
  std::vector<std::thread> threads_;
  // The job; written only while no worker is inside one (state_ == 0).
  const RangeFn* job_ = nullptr;
  int64_t num_items_ = 0, grain_ = 1;
  std::atomic<int64_t> next_chunk_{0};
  std::atomic<uint32_t> state_{0};  // kOpen | number of workers inside the job
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::condition_variable wake_;  // workers: a new generation
  std::condition_variable done_;  // the caller: the last worker left a closed job
};

// The process-wide pool; set_num_threads(n) replaces it (n <= 0: physical cores).
ThreadPool& pool();
void set_num_threads(int num_threads);
int physical_cores();

}  // namespace tinyvllm::cpu

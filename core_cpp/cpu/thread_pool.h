// One persistent pool of std::threads for the CPU kernels. The caller is worker 0: a pool of n
// threads starts n - 1. Between jobs a worker spins briefly (the next projection usually follows
// within tens of microseconds), yielding its core to anyone runnable, then sleeps on a condition
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
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }
  // Runs fn(worker, num_threads) on every worker, the caller included; returns when all are done.
  // Not reentrant: one job at a time (callers hold the GIL-released kernel lock, see linear.cpp).
  void run(const std::function<void(int, int)>& fn);

 private:
  void worker_loop(int worker);
  bool wait_for_job(uint64_t seen);
  template <typename Ready>
  void wait(Ready ready, std::condition_variable& cv);

  int num_threads_;
  std::vector<std::thread> threads_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::condition_variable wake_;  // workers: a new generation
  std::condition_variable done_;  // the caller: pending_ reached 0
};

// The process-wide pool; set_num_threads(n) replaces it (n <= 0: physical cores).
ThreadPool& pool();
void set_num_threads(int num_threads);
int physical_cores();

}  // namespace tinyvllm::cpu

// A small fork-join pool for the attention kernel.
//
// Workers poll for a while after a job (decode calls the kernel once per
// layer, so the next job usually arrives within a millisecond), yielding the
// core between polls, and then sleep on a condition variable, so an idle
// engine does not burn cores. Measured on the 2-vCPU development VM: 0.2-2 us
// per dispatch for calls 0-500 us apart, against 0.5-1.1 us for an OpenMP
// parallel region (libgomp), which would also be a second OpenMP runtime
// beside the one torch bundles; a sleeping worker takes ~30 us to wake.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem {

class ThreadPool {
 public:
  ThreadPool() = default;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool();

  // Runs task(i) for every i in [0, num_threads): i == 0 on the calling thread,
  // the rest on workers (started on first need). Returns when all are done.
  // Concurrent callers take turns; the task must not throw.
  void run(int num_threads, const std::function<void(int)>& task);

  // The process-wide pool. A forked child gets a fresh one, since the parent's
  // worker threads do not exist there.
  static ThreadPool& instance();

 private:
  void start_workers(int count);
  void worker_loop(int index, uint64_t seen);
  uint64_t wait_for_job(uint64_t seen);

  static constexpr int kActiveBits = 16;

  std::mutex call_mutex_;  // one parallel region at a time
  std::mutex wake_mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* task_ = nullptr;
  bool stopping_ = false;
  // Job counter << kActiveBits | number of threads in that job, in one word so a
  // worker that wakes late can never pair one job's thread count with another job.
  std::atomic<uint64_t> job_{0};
  std::atomic<int> pending_{0};          // workers still running the current job
  std::atomic<int> num_sleeping_{0};
};

}  // namespace tandem

#include "thread_pool.h"

#include <pthread.h>

#include <chrono>

namespace tandem {
namespace {

// How long an idle worker polls for the next job before sleeping. Waking a
// sleeping thread took ~30 us on the 2-vCPU development VM, against ~0.3 us
// for a polling one, and one decode step calls the kernel once per layer with
// gaps of 0.1-1 ms. After kBusySpinTime of tight polling the worker yields
// between polls, so torch's threads running between two calls get the core.
constexpr auto kBusySpinTime = std::chrono::microseconds(20);
constexpr auto kSpinTime = std::chrono::microseconds(1000);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

ThreadPool* g_pool = nullptr;
std::once_flag g_atfork_once;

// In a forked child only the forking thread exists; abandon (leak) the
// parent's pool so the child starts its own workers on first use.
void forget_pool_in_child() { g_pool = nullptr; }

}  // namespace

ThreadPool& ThreadPool::instance() {
  static std::mutex instance_mutex;
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
  std::lock_guard<std::mutex> lock(instance_mutex);
  // Never destroyed: workers may still be parked at interpreter exit.
  if (g_pool == nullptr) g_pool = new ThreadPool();
  return *g_pool;
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    stopping_ = true;
    job_.fetch_add(uint64_t{1} << kActiveBits, std::memory_order_release);
  }
  wake_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void ThreadPool::start_workers(int count) {
  while (static_cast<int>(workers_.size()) < count) {
    const int index = static_cast<int>(workers_.size()) + 1;  // 0 is the caller
    // Read here, before the job that needs the worker is published: the new
    // thread may start running only after that, and must not skip the job.
    const uint64_t seen = job_.load(std::memory_order_relaxed);
    workers_.emplace_back([this, index, seen] { worker_loop(index, seen); });
  }
}

uint64_t ThreadPool::wait_for_job(uint64_t seen) {
  const auto start = std::chrono::steady_clock::now();
  for (auto now = start; now - start < kSpinTime; now = std::chrono::steady_clock::now()) {
    for (int i = 0; i < 64; ++i) {
      const uint64_t job = job_.load(std::memory_order_acquire);
      if (job != seen) return job;
      cpu_relax();
    }
    if (now - start > kBusySpinTime) std::this_thread::yield();
  }
  std::unique_lock<std::mutex> lock(wake_mutex_);
  num_sleeping_.fetch_add(1, std::memory_order_relaxed);
  wake_.wait(lock, [&] { return job_.load(std::memory_order_acquire) != seen; });
  num_sleeping_.fetch_sub(1, std::memory_order_relaxed);
  return job_.load(std::memory_order_acquire);
}

void ThreadPool::worker_loop(int index, uint64_t seen) {
  for (;;) {
    seen = wait_for_job(seen);
    if (stopping_) return;
    const int num_active = static_cast<int>(seen & ((uint64_t{1} << kActiveBits) - 1));
    if (index < num_active) {
      (*task_)(index);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
}

void ThreadPool::run(int num_threads, const std::function<void(int)>& task) {
  if (num_threads <= 1) {
    task(0);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  start_workers(num_threads - 1);
  task_ = &task;
  pending_.store(num_threads - 1, std::memory_order_relaxed);
  {
    // Publishing under wake_mutex_ orders it against a worker's check-then-sleep,
    // so num_sleeping_ read afterwards cannot miss a sleeper.
    std::lock_guard<std::mutex> lock(wake_mutex_);
    const uint64_t counter = (job_.load(std::memory_order_relaxed) >> kActiveBits) + 1;
    job_.store(counter << kActiveBits | static_cast<uint64_t>(num_threads), std::memory_order_release);
  }
  if (num_sleeping_.load(std::memory_order_relaxed) > 0) wake_.notify_all();
  task(0);
  for (int spins = 0; pending_.load(std::memory_order_acquire) > 0; ++spins) {
    if (spins < 4096) {
      cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace tandem

// The host budget: a bound on the offloaded bytes that live in host memory at
// once, shared by every scope of the process.
//
// A pack that would exceed it goes to the spill tier (when the scope has one)
// or stays on the device; it never allocates host memory beyond the bound.
// The default ("auto") is 80 % of the node's MemAvailable at first use,
// divided by the ranks on this node (local_size.h: the ranks of one node share its RAM).
//
// Thread-safety: every method may be called from any thread; one mutex guards
// the limit and the counters; waiters sleep on one condition variable, woken
// whenever bytes are given back (and by wake()). A HostLease is owned by one
// record.
#pragma once

#include "hsoffload/stats.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

namespace hsoffload {

// What "auto" was computed from, for the log line that reports it.
struct AutoBudget {
  int64_t mem_available = 0;   // bytes, /proc/meminfo MemAvailable (0: unknown; then physical memory is used)
  int64_t local_world_size = 1;  // local_size(): the ranks on this node, 1 when no variable names them
  int64_t limit = 0;           // kAutoHostBudgetFraction (options.h) * mem_available / local_world_size
};
// Reads the figures now.
AutoBudget compute_auto_budget();

class HostBudget;

// Bytes reserved in a HostBudget; given back when destroyed. Move-only.
class HostLease {
 public:
  HostLease() = default;
  HostLease(const HostLease&) = delete;
  HostLease& operator=(const HostLease&) = delete;
  HostLease(HostLease&& other) noexcept;
  HostLease& operator=(HostLease&& other) noexcept;
  ~HostLease();
  int64_t bytes() const { return bytes_; }

 private:
  friend class HostBudget;
  void release();
  std::shared_ptr<HostBudget> budget_;
  int64_t bytes_ = 0;
};

class HostBudget : public std::enable_shared_from_this<HostBudget> {
 public:
  // `limit` < 0: auto, resolved at first use.
  static std::shared_ptr<HostBudget> create(int64_t limit);
  // Reserves `bytes` if in_flight + bytes stays within the limit; otherwise
  // returns false and `lease` is untouched.
  bool try_reserve(int64_t bytes, HostLease& lease);
  // Whether try_reserve(bytes) would succeed now (reserves nothing; another thread may take the room first).
  bool fits(int64_t bytes);
  // Blocks the calling thread (which must hold no lock that a lease's release needs) until fits(bytes), until
  // `deadline`, or until `give_up()` (asked under the budget's mutex, so it must not take it) says so; returns
  // fits(bytes) then. Woken by every give-back and by wake().
  bool wait_for_room(int64_t bytes, std::chrono::steady_clock::time_point deadline,
                     const std::function<bool()>& give_up);
  // Wakes every wait_for_room (something its give_up() reads has changed).
  void wake();
  // Changes the limit (< 0: auto, recomputed now). Live leases are kept even
  // if they exceed a lower limit; new ones must fit. Resets `peak` to the
  // bytes in flight now and `refused` to 0.
  void set_limit(int64_t limit);
  // The counters (an auto limit's figures included); resolves an auto limit first.
  BudgetStats stats();

 private:
  explicit HostBudget(int64_t limit);
  friend class HostLease;
  void give_back(int64_t bytes);
  void resolve_locked();

  std::mutex mutex_;
  std::condition_variable room_freed_;
  BudgetStats stats_;  // is_auto, mem_available and local_world_size are filled in by stats()
  bool is_auto_ = true;     // the limit comes from compute_auto_budget()
  AutoBudget auto_figures_;  // valid when is_auto_ and resolved_
  bool resolved_ = false;
};

// The process-wide budget: one per process because the host RAM it bounds is
// shared by every scope and thread; created on first use.
std::shared_ptr<HostBudget> global_host_budget();

}  // namespace hsoffload

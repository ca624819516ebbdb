// The process-wide host budget (host_budget.h): byte reservations of live records against one limit.
#include "hsoffload/host_budget.h"

#include "hsoffload/local_size.h"
#include "hsoffload/options.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>

namespace hsoffload {

AutoBudget compute_auto_budget() {
  AutoBudget a;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t value = 0;
  std::string unit;
  while (meminfo >> key >> value >> unit) {
    if (key == "MemAvailable:") {
      a.mem_available = value * 1024;
      break;
    }
  }
  if (a.mem_available <= 0) {
    a.mem_available = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  }
  a.local_world_size = local_size().ranks;
  a.limit = static_cast<int64_t>(static_cast<double>(a.mem_available) * kAutoHostBudgetFraction) / a.local_world_size;
  return a;
}

HostLease::HostLease(HostLease&& other) noexcept : budget_(std::move(other.budget_)), bytes_(other.bytes_) {
  other.bytes_ = 0;
}

HostLease& HostLease::operator=(HostLease&& other) noexcept {
  if (this != &other) {
    release();
    budget_ = std::move(other.budget_);
    bytes_ = other.bytes_;
    other.bytes_ = 0;
  }
  return *this;
}

HostLease::~HostLease() { release(); }

void HostLease::release() {
  if (budget_) {
    budget_->give_back(bytes_);
  }
  budget_.reset();
  bytes_ = 0;
}

std::shared_ptr<HostBudget> HostBudget::create(int64_t limit) {
  return std::shared_ptr<HostBudget>(new HostBudget(limit));  // private ctor
}

HostBudget::HostBudget(int64_t limit) {
  is_auto_ = limit < 0;
  stats_.limit = std::max<int64_t>(limit, 0);
  resolved_ = limit >= 0;
}

void HostBudget::resolve_locked() {
  if (!resolved_) {
    auto_figures_ = compute_auto_budget();
    stats_.limit = auto_figures_.limit;
    resolved_ = true;
  }
}

bool HostBudget::try_reserve(int64_t bytes, HostLease& lease) {
  TORCH_INTERNAL_ASSERT(bytes >= 0 && !lease.budget_);
  std::lock_guard<std::mutex> lock(mutex_);
  resolve_locked();
  if (stats_.in_flight + bytes > stats_.limit) {
    stats_.refused += 1;
    return false;
  }
  stats_.in_flight += bytes;
  stats_.peak = std::max(stats_.peak, stats_.in_flight);
  lease.budget_ = shared_from_this();
  lease.bytes_ = bytes;
  return true;
}

bool HostBudget::fits(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  resolve_locked();
  return stats_.in_flight + bytes <= stats_.limit;
}

bool HostBudget::wait_for_room(int64_t bytes, std::chrono::steady_clock::time_point deadline,
                               const std::function<bool()>& give_up) {
  std::unique_lock<std::mutex> lock(mutex_);
  resolve_locked();
  room_freed_.wait_until(lock, deadline, [&] { return stats_.in_flight + bytes <= stats_.limit || give_up(); });
  return stats_.in_flight + bytes <= stats_.limit;
}

void HostBudget::wake() {
  { std::lock_guard<std::mutex> lock(mutex_); }  // a waiter between its predicate and its sleep sees the change
  room_freed_.notify_all();
}

void HostBudget::give_back(int64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.in_flight -= bytes;
  }
  room_freed_.notify_all();
}

void HostBudget::set_limit(int64_t limit) {
  std::lock_guard<std::mutex> lock(mutex_);
  is_auto_ = limit < 0;
  resolved_ = false;
  if (limit >= 0) {
    stats_.limit = limit;
    resolved_ = true;
  }
  resolve_locked();
  stats_.peak = stats_.in_flight;
  stats_.refused = 0;
  room_freed_.notify_all();
}

BudgetStats HostBudget::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  resolve_locked();
  BudgetStats s = stats_;
  s.is_auto = is_auto_ ? 1 : 0;
  s.mem_available = auto_figures_.mem_available;
  s.local_world_size = auto_figures_.local_world_size;
  return s;
}

std::shared_ptr<HostBudget> global_host_budget() {
  // Function-local static: created once, thread-safe initialisation (C++11).
  static const std::shared_ptr<HostBudget> budget = HostBudget::create(-1);
  return budget;
}

}  // namespace hsoffload

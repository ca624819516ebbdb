// The spill tier: offloaded tensors that do not fit the host budget go to
// anonymous files in a directory (`spill_dir`), written and read back by
// background I/O threads.
//
// Files are opened with O_TMPFILE (or created and unlinked at once where the
// file system has no O_TMPFILE), so they have no name: a crash or kill -9
// leaves nothing on disk, and closing the descriptor frees the space. I/O is
// O_DIRECT where the file system accepts it (page cache bypassed, so spilling
// does not evict the data loader's pages), plain pwrite/pread otherwise.
//
// Two kinds of write: `write_host` writes a host copy (a host block the pack
// already filled at copy speed; the I/O thread waits for that copy's event,
// transfer.h's `wait_host_copy`, then memcpy's it through its staging chunk),
// the normal path; `write` writes device bytes (device -> staging on a side
// stream -> file), only for a tensor larger than the whole host budget. Reads go
// file -> staging -> device. The stream order of those copies is transfer.h's;
// this file touches no stream or event itself. Staging chunks are pinned when
// the store serves an accelerator.
//
// Thread-safety: SpillStore's methods may be called from any thread; its
// queue is guarded by one mutex. Each SpillFile and SpillRead guards its own
// state. The I/O threads touch only the jobs they take, their own staging
// chunk and the file descriptors of those jobs; the callbacks a job runs
// (`write_host`'s take and done) are the caller's and must not take a lock that
// is held while waiting for a read (a scope's mutex).
#pragma once

#include "hsoffload/host_pool.h"
#include "hsoffload/stats.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace hsoffload {

// First error of a scope's spill writes, reported on that scope's thread (a
// write fails on an I/O thread, after its pack returned).
class SpillErrors {
 public:
  void set(const std::string& message);
  // The first error since the last call, or "" (and clears it).
  std::string take();
  // Whether take() would return an error now.
  bool pending();
  // Errors set since this object was made (take() does not reset it).
  int64_t count();

 private:
  std::mutex mutex_;
  std::string first_;
  int64_t count_ = 0;
};

class SpillFile;
class SpillStore;

// A read of a spilled tensor back into its destination, in flight or done.
class SpillRead {
 public:
  // Blocks until the read is complete; raises naming the file's directory if
  // it failed. Returns the event consumers must wait on (null for CPU).
  std::shared_ptr<c10::Event> wait();

 private:
  friend class SpillStore;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
  std::shared_ptr<c10::Event> done_event_;
};

// The bytes of one host copy, handed to an I/O thread when it starts a `write_host` job.
struct HostSource {
  std::vector<at::Tensor> extents;           // host bytes in order (uint8, contiguous), summing to the file's size
  std::shared_ptr<c10::Event> d2h_done;      // completes when the extents hold the bytes; null: they do now
  std::shared_ptr<void> owner;               // keeps the extents' block lent until the job is done
};

class SpillStore {
 public:
  // The store for `dir`, shared by every scope that spills there (one set of
  // I/O threads per directory). Raises naming `dir` if it does not exist, is
  // not a directory or is not writable.
  // Its staging chunks count in `pool`'s account (HostPool::add_staging) while the store lives.
  static std::shared_ptr<SpillStore> open(const std::string& dir, bool pinned_staging,
                                          std::shared_ptr<HostPool> pool);
  ~SpillStore();
  SpillStore(const SpillStore&) = delete;
  SpillStore& operator=(const SpillStore&) = delete;

  // Starts writing `src` (a contiguous uint8 tensor on the CPU or a device) to
  // a new anonymous file and returns it. For a device tensor, `produced` is
  // recorded on the stream that wrote it and `copy_stream` is where the I/O
  // thread copies it to staging; `src` is held until it has been copied. A
  // failure is reported to `errors` (and to every read of the file).
  std::shared_ptr<SpillFile> write(at::Tensor src, std::shared_ptr<c10::Event> produced,
                                   std::optional<c10::Stream> copy_stream, std::shared_ptr<SpillErrors> errors);
  // Writes a host copy of `bytes` bytes to a new anonymous file in the background, oldest request first. On an
  // I/O thread: `take()` returns the bytes to write, or nullopt if nobody needs them any more (the job ends
  // there); then the file is created, written, and `done(file, "")` is called, or `done(nullptr, message)` if
  // creating or writing it failed (ENOSPC, EIO: the message names the directory and the bytes free there).
  using TakeHost = std::function<std::optional<HostSource>()>;
  using HostWritten = std::function<void(std::shared_ptr<SpillFile> file, const std::string& error)>;
  void write_host(int64_t bytes, TakeHost take, HostWritten done);
  // Starts reading `file` into `dst` (uint8, the file's size, CPU or device),
  // after the file's write has finished. For a device, `allocated` is recorded
  // on the stream that allocated `dst` and copies run on `copy_stream`.
  std::shared_ptr<SpillRead> read(std::shared_ptr<SpillFile> file, at::Tensor dst,
                                  std::shared_ptr<c10::Event> allocated, std::optional<c10::Stream> copy_stream);
  const std::string& dir() const { return dir_; }
  SpillStats stats() const;
  static constexpr int64_t kChunkBytes = int64_t{8} << 20;
  static constexpr int64_t kIoThreads = 2;

 private:
  SpillStore(std::string dir, bool pinned_staging, std::shared_ptr<HostPool> pool);
  using Job = std::function<void(const at::Tensor& staging)>;
  void enqueue(Job job);
  // The job queue, shared with the I/O threads so that a store whose last reference goes away inside a job (on an
  // I/O thread) can end: that thread is detached and leaves its loop through the queue, never touching the store.
  struct Queue {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Job> jobs;
    bool stop = false;
  };
  static void worker(const std::shared_ptr<Queue>& queue, const at::Tensor& staging);
  void run_write(const std::shared_ptr<SpillFile>& file, at::Tensor src, const std::shared_ptr<c10::Event>& produced,
                 const std::optional<c10::Stream>& copy_stream, const at::Tensor& staging);
  void run_write_host(int64_t bytes, const TakeHost& take, const HostWritten& done, const at::Tensor& staging);
  void run_read(const std::shared_ptr<SpillFile>& file, const at::Tensor& dst,
                const std::shared_ptr<c10::Event>& allocated, const std::optional<c10::Stream>& copy_stream,
                const std::shared_ptr<SpillRead>& read, const at::Tensor& staging);
  // A new anonymous file of `bytes` (blocks reserved), or null with `error` set.
  std::shared_ptr<SpillFile> create_file(int64_t bytes, std::shared_ptr<SpillErrors> errors, std::string& error);
  std::string io_error(const char* what, int err, int64_t bytes, int fd) const;

  const std::string dir_;
  mutable std::mutex mutex_;  // guards stats_
  const std::shared_ptr<Queue> queue_ = std::make_shared<Queue>();
  SpillStats stats_;
  std::shared_ptr<std::atomic<int64_t>> open_files_ = std::make_shared<std::atomic<int64_t>>(0);
  std::vector<at::Tensor> staging_;  // one chunk per I/O thread, 4096-aligned
  const std::shared_ptr<HostPool> pool_;  // whose account holds the staging bytes
  bool pinned_staging_ = false;
  // A test knob: every write sleeps this long first, so tests can make the disk lag the packs
  // ($HSOFFLOAD_TEST_SPILL_WRITE_DELAY_MS, read when the store is created).
  int64_t write_delay_ms_ = 0;  // HSOFFLOAD_TEST_SPILL_WRITE_DELAY_MS
  int64_t read_delay_ms_ = 0;   // HSOFFLOAD_TEST_SPILL_READ_DELAY_MS
  void lag_for_tests(bool write) const;  // every write and read calls it first (a lagging disk, for tests)
  std::vector<std::thread> threads_;
};

}  // namespace hsoffload

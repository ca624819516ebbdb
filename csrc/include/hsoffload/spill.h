// The spill tier: offloaded tensors that do not fit the host budget go to
// anonymous files in a directory (`spill_dir`), written and read back by
// background I/O threads.
//
// Files are opened with O_TMPFILE (or created and unlinked at once where the
// file system has no O_TMPFILE), so they have no name: a crash or kill -9
// leaves nothing on disk, and closing the descriptor frees the space. I/O is
// O_DIRECT where the file system accepts it (page cache bypassed, so spilling
// does not evict the data loader's pages), plain pwrite/pread otherwise.
// Device bytes move through one staging chunk per I/O thread (pinned when the
// store serves an accelerator): device -> staging (side stream, waited on by
// the I/O thread) -> file, and file -> staging -> device. The stream order of
// those copies is transfer.h's (stage_to_host / stage_to_device); this file
// touches no stream or event itself.
//
// Thread-safety: SpillStore's methods may be called from any thread; its
// queue is guarded by one mutex. Each SpillFile and SpillRead guards its own
// state. The I/O threads touch only the jobs they take, their own staging
// chunk and the file descriptors of those jobs.
#pragma once

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

 private:
  std::mutex mutex_;
  std::string first_;
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

class SpillStore {
 public:
  // The store for `dir`, shared by every scope that spills there (one set of
  // I/O threads per directory). Raises naming `dir` if it does not exist, is
  // not a directory or is not writable.
  static std::shared_ptr<SpillStore> open(const std::string& dir, bool pinned_staging);
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
  SpillStore(std::string dir, bool pinned_staging);
  using Job = std::function<void(const at::Tensor& staging)>;
  void enqueue(Job job);
  void worker(int index);
  void run_write(const std::shared_ptr<SpillFile>& file, at::Tensor src, const std::shared_ptr<c10::Event>& produced,
                 const std::optional<c10::Stream>& copy_stream, const at::Tensor& staging);
  void run_read(const std::shared_ptr<SpillFile>& file, const at::Tensor& dst,
                const std::shared_ptr<c10::Event>& allocated, const std::optional<c10::Stream>& copy_stream,
                const std::shared_ptr<SpillRead>& read, const at::Tensor& staging);
  std::string io_error(const char* what, int err, int64_t bytes, int fd) const;

  const std::string dir_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool stop_ = false;
  SpillStats stats_;
  std::shared_ptr<std::atomic<int64_t>> open_files_ = std::make_shared<std::atomic<int64_t>>(0);
  std::vector<at::Tensor> staging_;  // one chunk per I/O thread, 4096-aligned
  std::vector<std::thread> threads_;
};

}  // namespace hsoffload

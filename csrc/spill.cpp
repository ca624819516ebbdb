// The spill tier (spill.h): anonymous files, I/O threads, staging chunks. Stream order comes from transfer.h.
#include "hsoffload/spill.h"

#include "hsoffload/cpu_meter.h"
#include "hsoffload/transfer.h"

#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>
#include <utility>

namespace hsoffload {

namespace {

constexpr int64_t kBlock = 4096;  // O_DIRECT alignment of buffers, offsets and lengths on every file system we meet

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// An anonymous file in `dir`; `direct` tells whether O_DIRECT took. -1 with errno set on failure.
int open_anonymous(const std::string& dir, bool& direct) {
  direct = true;
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC | O_DIRECT, 0600);
  if (fd < 0 && errno == EINVAL) {  // O_DIRECT refused (tmpfs), or no O_TMPFILE
    direct = false;
    fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  }
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
    // No O_TMPFILE here: a named file, unlinked at once (nothing is left if we die after this line).
    std::string path = dir + "/.hsoffload-spill-XXXXXX";
    std::vector<char> name(path.begin(), path.end());
    name.push_back('\0');
    fd = ::mkstemp(name.data());
    if (fd >= 0) {
      ::unlink(name.data());
      const int flags = ::fcntl(fd, F_GETFL);
      direct = flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_DIRECT) == 0;
    }
  }
  return fd;
}

int64_t free_bytes(int fd) {
  struct statvfs s {};
  return ::fstatvfs(fd, &s) == 0 ? static_cast<int64_t>(s.f_bavail) * static_cast<int64_t>(s.f_frsize) : -1;
}

// Whether pinned host memory can be had: an accelerator that is actually usable, not merely one this torch was built
// for (a CUDA wheel on a machine without a driver names CUDA as its accelerator, and asking it for pinned memory
// throws "Found no NVIDIA driver on your system"). The hooks' isAvailable() asks the driver and never throws;
// at::accelerator::deviceCount() is no substitute: on torch 2.11 without a driver it says 0 until torch.compile has
// run in the process, then 8 (measured).
bool accelerator_usable() {
  const auto accelerator = at::getAccelerator(/*checked=*/false);
  return accelerator.has_value() && at::globalContext().getAcceleratorHooksInterface(*accelerator).isAvailable();
}

// One 4096-aligned chunk of `bytes` (a power of two); `held` := the host bytes it costs. Asked for exactly `bytes`
// first: the accelerators' caching host allocators round a pinned request up to a power of two, so the padded
// `bytes + 4096` cost twice `bytes` (16 MiB per 8 MiB chunk). Pinned blocks are page-aligned; only a misaligned
// buffer is replaced by a padded one.
at::Tensor aligned_chunk(int64_t bytes, bool pinned, int64_t& held) {
  const auto options = at::TensorOptions().dtype(at::kByte).device(at::kCPU).pinned_memory(pinned);
  const HostAllocation host;  // staging for spill files: the CPU meter does not count it as the device's
  at::Tensor raw = at::empty({bytes}, options);
  if (reinterpret_cast<uintptr_t>(raw.data_ptr()) % kBlock != 0) {
    raw = at::empty({bytes + kBlock}, options);
  }
  held = raw.numel();
  if (pinned) {
    int64_t rounded = 1;
    while (rounded < held) rounded *= 2;
    held = rounded;
  }
  const auto addr = reinterpret_cast<uintptr_t>(raw.data_ptr());
  const int64_t skip = static_cast<int64_t>((kBlock - addr % kBlock) % kBlock);
  return raw.narrow(0, skip, bytes);
}

}  // namespace

// One spilled tensor's file. The descriptor is closed (and the space freed) with the last reference: its record's,
// or that of an I/O job still working on it.
class SpillFile {
 public:
  SpillFile(int fd, int64_t bytes, bool direct, std::shared_ptr<SpillErrors> errors,
            std::shared_ptr<std::atomic<int64_t>> open_files)
      : fd_(fd), bytes_(bytes), direct_(direct), errors_(std::move(errors)), open_files_(std::move(open_files)) {
    open_files_->fetch_add(1);
  }
  ~SpillFile() {
    ::close(fd_);
    open_files_->fetch_sub(1);
  }
  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;

  int fd() const { return fd_; }
  int64_t bytes() const { return bytes_; }

  // Writes or reads `len` bytes at `offset`, retrying short transfers and EINTR; falls back to buffered I/O if the
  // file system refuses O_DIRECT at transfer time. Returns 0 or an errno.
  int transfer(bool write, void* buf, int64_t len, int64_t offset) {
    auto* p = static_cast<char*>(buf);
    while (len > 0) {
      const ssize_t n = write ? ::pwrite(fd_, p, len, offset) : ::pread(fd_, p, len, offset);
      if (n < 0 && errno == EINTR) continue;
      const int err = errno;
      if (n < 0 && err == EINVAL && direct_) {
        direct_ = false;
        const int flags = ::fcntl(fd_, F_GETFL);
        if (flags >= 0 && ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT) == 0) continue;
      }
      if (n < 0) return err;
      if (n == 0) return write ? ENOSPC : EIO;  // no progress: full, or a file shorter than written
      p += n;
      offset += n;
      len -= n;
    }
    return 0;
  }

  std::mutex mutex;
  bool written = false;           // the write finished (successfully or not)
  std::string error;              // why the write failed ("" if it did not)
  // Reads requested before the write finished; called with this file (they do not hold it: no cycle).
  std::vector<std::function<void(const std::shared_ptr<SpillFile>&)>> after_write;

  const std::shared_ptr<SpillErrors>& errors() const { return errors_; }

 private:
  int fd_;
  int64_t bytes_;
  bool direct_;
  std::shared_ptr<SpillErrors> errors_;
  std::shared_ptr<std::atomic<int64_t>> open_files_;  // the store's count, shared so a file may outlive the store
};

// ---------------------------------------------------------------------------

void SpillErrors::set(const std::string& message) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++count_;
  if (first_.empty()) first_ = message;
}

int64_t SpillErrors::count() {
  std::lock_guard<std::mutex> lock(mutex_);
  return count_;
}

std::string SpillErrors::take() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(first_, std::string());
}

bool SpillErrors::pending() {
  std::lock_guard<std::mutex> lock(mutex_);
  return !first_.empty();
}

std::shared_ptr<c10::Event> SpillRead::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [this] { return done_; });
  TORCH_CHECK(error_.empty(), error_);
  return done_event_;
}

// ---------------------------------------------------------------------------

std::shared_ptr<SpillStore> SpillStore::open(const std::string& dir, bool pinned_staging,
                                             std::shared_ptr<HostPool> pool) {
  struct stat st {};
  TORCH_CHECK_VALUE(!dir.empty(), "hsoffload: spill_dir is empty; pass a directory on a local disk");
  TORCH_CHECK_VALUE(::stat(dir.c_str(), &st) == 0, "hsoffload: spill_dir '", dir, "' does not exist (",
                    std::strerror(errno), "); create it, or pass an existing directory on a local disk");
  TORCH_CHECK_VALUE(S_ISDIR(st.st_mode), "hsoffload: spill_dir '", dir,
                    "' is not a directory; pass a directory (spill files are created inside it)");
  bool direct = false;
  const int probe = open_anonymous(dir, direct);
  TORCH_CHECK_VALUE(probe >= 0, "hsoffload: spill_dir '", dir, "' is not writable (", std::strerror(errno),
                    "); pass a directory this process can create files in");
  ::close(probe);
  // One store per directory, shared by the scopes that spill there, so a new scope per step does not start new
  // threads and staging buffers. Weak entries: the store lives while a scope or a spilled record holds it.
  static std::mutex registry_mutex;
  static std::map<std::string, std::weak_ptr<SpillStore>> registry;
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& slot = registry[dir];
  if (auto existing = slot.lock()) {
    return existing;
  }
  const bool pinned = pinned_staging && accelerator_usable();
  std::shared_ptr<SpillStore> store(new SpillStore(dir, pinned, std::move(pool)));  // private ctor
  store->stats_.direct_io = direct;
  slot = store;
  return store;
}

SpillStore::SpillStore(std::string dir, bool pinned_staging, std::shared_ptr<HostPool> pool)
    : dir_(std::move(dir)), pool_(std::move(pool)), pinned_staging_(pinned_staging) {
  if (const char* delay = std::getenv("HSOFFLOAD_TEST_SPILL_WRITE_DELAY_MS")) {
    write_delay_ms_ = std::max<int64_t>(0, std::strtoll(delay, nullptr, 10));
  }
  if (const char* delay = std::getenv("HSOFFLOAD_TEST_SPILL_READ_DELAY_MS")) {
    read_delay_ms_ = std::max<int64_t>(0, std::strtoll(delay, nullptr, 10));
  }
  for (int64_t i = 0; i < kIoThreads; ++i) {
    int64_t held = 0;
    staging_.push_back(aligned_chunk(kChunkBytes, pinned_staging, held));
    stats_.staging_bytes += held;
  }
  if (pool_) pool_->add_staging(stats_.staging_bytes, pinned_staging_);
  for (int64_t i = 0; i < kIoThreads; ++i) {
    threads_.emplace_back(worker, queue_, staging_[i]);
  }
}

SpillStore::~SpillStore() {
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    queue_->stop = true;
    queue_->jobs.clear();  // nobody holds a record of these files any more: their data is not needed
  }
  queue_->cv.notify_all();
  if (pool_) pool_->add_staging(-stats_.staging_bytes, pinned_staging_);  // freed with staging_ (the detached
                                                                        // thread's copy of its chunk aside)
  for (auto& t : threads_) {
    if (t.get_id() == std::this_thread::get_id()) {
      t.detach();  // the last reference went inside a job on this I/O thread: it leaves its loop through the queue
    } else {
      t.join();
    }
  }
}

void SpillStore::enqueue(Job job) {
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    if (queue_->stop) return;
    queue_->jobs.push_back(std::move(job));
  }
  queue_->cv.notify_one();
}

void SpillStore::worker(const std::shared_ptr<Queue>& queue, const at::Tensor& staging) {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(queue->mutex);
      queue->cv.wait(lock, [&] { return queue->stop || !queue->jobs.empty(); });
      if (queue->stop) return;
      job = std::move(queue->jobs.front());
      queue->jobs.pop_front();
    }
    try {
      job(staging);
    } catch (const std::exception& e) {
      // Jobs report their own errors (to the scope, or to the read); an exception here is a bug, and one that
      // left a std::thread would end the process.
      std::fprintf(stderr, "hsoffload: a spill I/O job failed unexpectedly: %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "hsoffload: a spill I/O job failed unexpectedly\n");
    }
  }
}

std::string SpillStore::io_error(const char* what, int err, int64_t bytes, int fd) const {
  const int64_t avail = free_bytes(fd);
  std::string message = std::string("hsoffload: ") + what + " " + std::to_string(bytes) + " bytes in spill_dir '" +
                        dir_ + "' failed: " + std::strerror(err) + " (errno " + std::to_string(err) + "); " +
                        (avail >= 0 ? std::to_string(avail) : std::string("unknown")) +
                        " bytes are free there. Free space in spill_dir, point spill_dir (HSOFFLOAD_SPILL_DIR) at a "
                        "larger local disk, or raise max_host_bytes.";
  return message;
}

std::shared_ptr<SpillFile> SpillStore::create_file(int64_t bytes, std::shared_ptr<SpillErrors> errors,
                                                   std::string& error) {
  bool direct = false;
  const int fd = open_anonymous(dir_, direct);
  const int err = errno;
  if (fd < 0) {
    error = std::string("hsoffload: cannot create a spill file in spill_dir '") + dir_ + "': " + std::strerror(err) +
            (err == EMFILE || err == ENFILE
                 ? "; every spilled tensor holds one open file: raise the open-file limit (ulimit -n) or "
                   "max_host_bytes"
                 : "; check that the directory still exists and is writable");
    return nullptr;
  }
  // Reserve the file's blocks now: the writes then allocate nothing (faster on ext4/xfs), and a disk without room
  // fails here, with the figures. File systems without fallocate just go on.
  if (::fallocate(fd, 0, 0, round_up(bytes, kBlock)) != 0 && (errno == ENOSPC || errno == EDQUOT)) {
    error = io_error("spilling a saved tensor of", errno, bytes, fd);
    ::close(fd);
    return nullptr;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.direct_io = direct;
  }
  return std::make_shared<SpillFile>(fd, bytes, direct, std::move(errors), open_files_);
}

void SpillStore::lag_for_tests(bool write) const {
  const int64_t ms = write ? write_delay_ms_ : read_delay_ms_;
  if (ms > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));  // a lagging disk
  }
}

std::shared_ptr<SpillFile> SpillStore::write(at::Tensor src, std::shared_ptr<c10::Event> produced,
                                             std::optional<c10::Stream> copy_stream,
                                             std::shared_ptr<SpillErrors> errors) {
  TORCH_INTERNAL_ASSERT(src.scalar_type() == at::kByte && src.dim() == 1 && src.is_contiguous());
  std::string error;
  auto file = create_file(src.numel(), std::move(errors), error);
  TORCH_CHECK(file != nullptr, error);  // in the pack: the forward fails with the figures
  enqueue([this, file, src = std::move(src), produced = std::move(produced), copy_stream](
              const at::Tensor& staging) mutable { run_write(file, std::move(src), produced, copy_stream, staging); });
  return file;
}

void SpillStore::write_host(int64_t bytes, TakeHost take, HostWritten done) {
  enqueue([this, bytes, take = std::move(take), done = std::move(done)](const at::Tensor& staging) {
    run_write_host(bytes, take, done, staging);
  });
}

void SpillStore::run_write_host(int64_t bytes, const TakeHost& take, const HostWritten& done,
                                const at::Tensor& staging) {
  RECORD_USER_SCOPE("hsoffload::spill_write");
  lag_for_tests(/*write=*/true);
  std::optional<HostSource> source;
  std::string error;
  try {
    source = take();
  } catch (const std::exception& e) {
    error = std::string("hsoffload: preparing a spill write failed: ") + e.what();
  }
  if (!source && error.empty()) {
    return;  // the graph that saved it is gone: nothing to write
  }
  const int64_t t0 = now_ns();
  std::shared_ptr<SpillFile> file = error.empty() ? create_file(bytes, nullptr, error) : nullptr;
  if (file) {
    try {
      wait_host_copy(source->d2h_done.get());  // throws on a failed device (a sticky CUDA error, say)
    } catch (const std::exception& e) {
      error = std::string("hsoffload: waiting for a saved tensor's copy to host before spilling it failed: ") +
              e.what();
    }
    auto* buf = static_cast<char*>(staging.data_ptr());
    size_t extent = 0;
    int64_t in_extent = 0;  // bytes of source->extents[extent] already written
    for (int64_t offset = 0; offset < bytes && error.empty(); offset += kChunkBytes) {
      const int64_t len = std::min(kChunkBytes, bytes - offset);
      for (int64_t filled = 0; filled < len;) {  // gather the chunk from the extents (host memory: a memcpy)
        const at::Tensor& e = source->extents[extent];
        const int64_t n = std::min(len - filled, e.numel() - in_extent);
        std::memcpy(buf + filled, static_cast<const char*>(e.data_ptr()) + in_extent, static_cast<size_t>(n));
        filled += n;
        in_extent += n;
        if (in_extent == e.numel()) {
          ++extent;
          in_extent = 0;
        }
      }
      const int64_t padded = round_up(len, kBlock);
      std::memset(buf + len, 0, padded - len);
      if (const int err = file->transfer(/*write=*/true, buf, padded, offset)) {
        error = io_error("spilling a saved tensor of", err, bytes, file->fd());
      }
    }
    {
      std::lock_guard<std::mutex> lock(file->mutex);
      file->written = true;
      file->error = error;
    }
    if (!error.empty()) {
      file.reset();  // closed: its space is given back now
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.write_ns += now_ns() - t0;
    if (error.empty()) stats_.bytes_written += bytes;
  }
  done(std::move(file), error);  // the caller's: must not throw (the scope's only moves and releases)
  source.reset();  // after done: the host block stays lent until its location has moved to the file
}

void SpillStore::run_write(const std::shared_ptr<SpillFile>& file, at::Tensor src,
                           const std::shared_ptr<c10::Event>& produced, const std::optional<c10::Stream>& copy_stream,
                           const at::Tensor& staging) {
  RECORD_USER_SCOPE("hsoffload::spill_write");
  lag_for_tests(/*write=*/true);
  const int64_t t0 = now_ns();
  const int64_t n = file->bytes();
  std::string error;
  auto* buf = static_cast<char*>(staging.data_ptr());
  for (int64_t offset = 0; offset < n && error.empty(); offset += kChunkBytes) {
    const int64_t len = std::min(kChunkBytes, n - offset);
    try {
      stage_to_host(staging.narrow(0, 0, len), src.narrow(0, offset, len), copy_stream,
                    offset == 0 ? produced.get() : nullptr);
    } catch (const std::exception& e) {
      error = std::string("hsoffload: copying a saved tensor to the spill staging buffer failed: ") + e.what();
      break;
    }
    const int64_t padded = round_up(len, kBlock);
    std::memset(buf + len, 0, padded - len);
    if (const int err = file->transfer(/*write=*/true, buf, padded, offset)) {
      error = io_error("spilling a saved tensor of", err, n, file->fd());
    }
  }
  src = at::Tensor();  // the device bytes are no longer needed
  std::vector<std::function<void(const std::shared_ptr<SpillFile>&)>> reads;
  {
    std::lock_guard<std::mutex> lock(file->mutex);
    file->written = true;
    file->error = error;
    reads.swap(file->after_write);
  }
  if (!error.empty()) {
    if (file->errors()) file->errors()->set(error);
    // Give the disk space back now rather than when the graph is freed: the data is lost anyway.
    if (::ftruncate(file->fd(), 0) != 0) { /* the space is freed when the file is closed */ }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.write_ns += now_ns() - t0;
    if (error.empty()) stats_.bytes_written += n;
  }
  for (auto& r : reads) r(file);
}

std::shared_ptr<SpillRead> SpillStore::read(std::shared_ptr<SpillFile> file, at::Tensor dst,
                                            std::shared_ptr<c10::Event> allocated,
                                            std::optional<c10::Stream> copy_stream) {
  TORCH_INTERNAL_ASSERT(dst.scalar_type() == at::kByte && dst.numel() == file->bytes() && dst.is_contiguous());
  auto read = std::make_shared<SpillRead>();
  auto start = [this, dst = std::move(dst), allocated = std::move(allocated), copy_stream,
                read](const std::shared_ptr<SpillFile>& f) {
    enqueue([this, f, dst, allocated, copy_stream, read](const at::Tensor& staging) {
      run_read(f, dst, allocated, copy_stream, read, staging);
    });
  };
  std::unique_lock<std::mutex> lock(file->mutex);
  if (!file->written) {
    file->after_write.push_back(std::move(start));
    return read;
  }
  lock.unlock();
  start(file);
  return read;
}

void SpillStore::run_read(const std::shared_ptr<SpillFile>& file, const at::Tensor& dst,
                          const std::shared_ptr<c10::Event>& allocated, const std::optional<c10::Stream>& copy_stream,
                          const std::shared_ptr<SpillRead>& read, const at::Tensor& staging) {
  RECORD_USER_SCOPE("hsoffload::spill_read");
  const int64_t t0 = now_ns();
  lag_for_tests(/*write=*/false);
  std::string error;
  {
    std::lock_guard<std::mutex> lock(file->mutex);
    error = file->error;
  }
  const int64_t n = file->bytes();
  auto* buf = static_cast<char*>(staging.data_ptr());
  std::shared_ptr<c10::Event> done;
  for (int64_t offset = 0; offset < n && error.empty(); offset += kChunkBytes) {
    const int64_t len = std::min(kChunkBytes, n - offset);
    if (const int err = file->transfer(/*write=*/false, buf, round_up(len, kBlock), offset)) {
      error = io_error("reading back a spilled tensor of", err, n, file->fd());
      break;
    }
    try {
      done = stage_to_device(dst.narrow(0, offset, len), staging.narrow(0, 0, len), copy_stream,
                             offset == 0 ? allocated.get() : nullptr);
    } catch (const std::exception& e) {
      error = std::string("hsoffload: copying a spilled tensor back to its device failed: ") + e.what();
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.read_ns += now_ns() - t0;
    if (error.empty()) stats_.bytes_read += n;
  }
  {
    std::lock_guard<std::mutex> lock(read->mutex_);
    read->done_ = true;
    read->error_ = error;
    read->done_event_ = std::move(done);
  }
  read->cv_.notify_all();
}

SpillStats SpillStore::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  SpillStats s = stats_;
  s.files = open_files_->load();
  return s;
}

}  // namespace hsoffload

// The allocation log behind MemoryTracker(source="allocator"): every allocation and free that
// PyTorch's allocators report on this thread (and on threads that inherit its debug info, such
// as autograd's), appended as (address, +-bytes) in C++, with no Python per allocation.
// The allocators report through c10::reportMemoryUsageToProfiler, which asks the thread-local
// PROFILER_STATE debug info; start() pushes this log there, stop() pops it. The slot takes one
// listener: start() refuses to run under PyTorch's profiler, and the profiler refuses to start
// while the log runs ("Profiler is already enabled on this thread").
// PyTorch reads whatever sits in that slot as a profiler's state (torch.autograd._profiler_enabled,
// torch._C._autograd._profiler_type, the profiler's own checks), so the log is one: a
// ProfilerStateBase whose configuration says "disabled" and whose type is NONE. Anything less is
// read through the wrong type (_profiler_type() crashed the process).
// Compiled at first use by fsdp_lab/memory/allocation_log.py (torch.utils.cpp_extension.load).
#include <torch/extension.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <mutex>
#include <vector>

namespace {

namespace profiler = torch::profiler::impl;

struct AllocationLog : public profiler::ProfilerStateBase {
  explicit AllocationLog(c10::DeviceType device_type)
      : profiler::ProfilerStateBase(profiler::ProfilerConfig(profiler::ProfilerState::Disabled)),
        device_type(device_type) {}
  const c10::DeviceType device_type;  // other devices' reports are left out (host scalars of a GPU step)
  std::mutex mutex;
  std::vector<int64_t> addresses, deltas;  // deltas in bytes: + allocated, - freed

  void reportMemoryUsage(void* ptr, int64_t alloc_size, size_t, size_t, c10::Device device) override {
    if (device.type() != device_type) return;
    std::lock_guard<std::mutex> guard(mutex);
    addresses.push_back(reinterpret_cast<int64_t>(ptr));
    deltas.push_back(alloc_size);
  }
  bool memoryProfilingEnabled() const override { return true; }
  profiler::ActiveProfilerType profilerType() override { return profiler::ActiveProfilerType::NONE; }
};

std::shared_ptr<AllocationLog> active;

void start(const std::string& device) {
  TORCH_CHECK(!active, "an allocation log is already running in this process (one MemoryTracker with "
              "source='allocator' at a time)");
  // the hook holds one listener a thread: under a running profiler this one would take its reports
  TORCH_CHECK(c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE) == nullptr,
              "PyTorch's profiler is running on this thread, and it listens on the hook the allocation "
              "log needs; stop the profiler first");
  active = std::make_shared<AllocationLog>(c10::Device(device).type());
  c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, active);
}

// how many reports were logged so far: stamps an event seen from Python into the log's order
int64_t position() {
  if (!active) return 0;
  std::lock_guard<std::mutex> guard(active->mutex);
  return static_cast<int64_t>(active->addresses.size());
}

// reports from index `first` on, as two lists (addresses, bytes). Copied as plain vectors under
// the lock: a tensor made here would be allocated by the allocator this log listens to.
std::pair<std::vector<int64_t>, std::vector<int64_t>> take(int64_t first) {
  TORCH_CHECK(active, "the allocation log is not running");
  std::lock_guard<std::mutex> guard(active->mutex);
  auto size = static_cast<int64_t>(active->addresses.size());
  TORCH_CHECK(first >= 0 && first <= size, "take(", first, ") outside the log's ", size, " reports");
  return {std::vector<int64_t>(active->addresses.begin() + first, active->addresses.end()),
          std::vector<int64_t>(active->deltas.begin() + first, active->deltas.end())};
}

void stop() {
  TORCH_CHECK(active, "the allocation log is not running");
  c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
  active.reset();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("start", &start);
  m.def("position", &position);
  m.def("take", &take);
  m.def("stop", &stop);
}

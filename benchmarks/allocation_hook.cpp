// Every allocation and free on this thread (and threads that inherit its debug info, such as
// autograd's), appended to a list in C++: what a tracker fed by the allocator would pay per
// allocation. PyTorch's allocators report to the profiler through c10::reportMemoryUsageToProfiler,
// which asks the thread-local PROFILER_STATE debug info; this pushes its own there.
// Built by benchmarks/memory_tracker.py with torch.utils.cpp_extension.load.
#include <torch/extension.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <mutex>
#include <vector>

namespace {

struct AllocationLog : public c10::MemoryReportingInfoBase {
  explicit AllocationLog(c10::DeviceType device_type) : device_type(device_type) {}
  const c10::DeviceType device_type;  // others' allocations are left out (host scalars of a GPU step)
  std::mutex mutex;
  std::vector<int64_t> addresses, deltas;  // deltas in bytes: + allocated, - freed

  void reportMemoryUsage(void* ptr, int64_t alloc_size, size_t, size_t, c10::Device device) override {
    if (device.type() != device_type) return;
    std::lock_guard<std::mutex> guard(mutex);
    addresses.push_back(reinterpret_cast<int64_t>(ptr));
    deltas.push_back(alloc_size);
  }
  bool memoryProfilingEnabled() const override { return true; }
};

std::shared_ptr<AllocationLog> active;

void start(const std::string& device) {
  TORCH_CHECK(!active, "allocation log already started");
  active = std::make_shared<AllocationLog>(c10::Device(device).type());
  c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, active);
}

// how many allocations and frees were logged so far: stamps an event seen from Python
int64_t position() {
  if (!active) return 0;
  std::lock_guard<std::mutex> guard(active->mutex);
  return static_cast<int64_t>(active->addresses.size());
}

std::vector<torch::Tensor> stop() {
  TORCH_CHECK(active, "allocation log not started");
  c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
  auto n = static_cast<int64_t>(active->addresses.size());
  auto addresses = torch::from_blob(active->addresses.data(), {n}, torch::kInt64).clone();
  auto deltas = torch::from_blob(active->deltas.data(), {n}, torch::kInt64).clone();
  active.reset();
  return {addresses, deltas};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("start", &start);
  m.def("position", &position);
  m.def("stop", &stop);
}

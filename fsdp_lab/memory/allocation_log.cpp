// The ledger behind MemoryTracker(source="allocator"): every allocation and free that PyTorch's
// allocators report on this thread (and on threads that inherit its debug info, such as
// autograd's) is booked as it happens, in C++, with no Python per allocation. Python tells it
// the few events that give storages their roles (a role, a mark, a tag_scope, a resize), and the
// two that come per tensor are heard here without Python: autograd's saved-tensor hooks call
// pack() and unpack() directly, and a storage first learnt of from Python is watched by a weak
// reference whose callback is C++. Every event is booked at once, in the reports' order, under
// the same lock.
// The bookkeeping is memory/ledger.py's StorageLedger (same categories, same rules for the peak's
// breakdown), keyed by address instead of by storage: tests/test_memory_tracker_allocator.py
// checks the two give the same numbers.
// The allocators report through c10::reportMemoryUsageToProfiler, which asks the thread-local
// PROFILER_STATE debug info; start() pushes this ledger there, stop() pops it. The slot takes one
// listener: start() refuses to run under PyTorch's profiler, and the profiler refuses to start
// while the ledger listens ("Profiler is already enabled on this thread").
// PyTorch reads whatever sits in that slot as a profiler's state (torch.autograd._profiler_enabled,
// torch._C._autograd._profiler_type, the profiler's own checks), so the ledger is one: a
// ProfilerStateBase whose configuration says "disabled" and whose type is NONE. Anything less is
// read through the wrong type (_profiler_type() crashed the process).
// Under the lock nothing may allocate through c10 (the report would wait for the lock) nor touch
// Python objects (freeing one can run a collection, whose finalizers may book an event).
// Compiled at first use by fsdp_lab/memory/allocation_log.py (torch.utils.cpp_extension.load).
// pybind with torch's casters, not <torch/extension.h>: that one pulls in every ATen operator and
// doubles the build's time.
#include <torch/csrc/utils/pybind.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

namespace profiler = torch::profiler::impl;
using Totals = std::vector<int64_t>;  // bytes by category index

struct Record {
  int64_t nbytes;
  int base;      // the role's category index
  int saved;     // how many saved-for-backward references autograd holds
  uint64_t id;   // tells a record from a later one at the same address
};

struct Results {
  Totals peak, current, maxes;
  int64_t peak_total;
  std::string peak_label;
  std::vector<std::pair<std::string, Totals>> timeline;
};

struct Ledger : public profiler::ProfilerStateBase {
  Ledger(const std::string& device, std::vector<std::string> names, const std::vector<std::string>& saved_become)
      : profiler::ProfilerStateBase(profiler::ProfilerConfig(profiler::ProfilerState::Disabled)),
        device_type(c10::Device(device).type()), names(std::move(names)) {
    for (size_t i = 0; i < this->names.size(); ++i) index[this->names[i]] = static_cast<int>(i);
    temporaries = category("temporaries");
    activations = category("activations");
    other = category("other");
    becomes_activation.assign(this->names.size(), false);
    for (const auto& name : saved_become) becomes_activation[category(name)] = true;
    totals.assign(this->names.size(), 0);
    maxes = peak_totals = totals;
  }

  ~Ledger() override {
    if (watches.empty() && !on_gone) return;  // (a frozen ledger holds no Python objects)
    if (!Py_IsInitialized()) {  // a ledger still listening when the process ends: Python is gone
      for (auto& entry : watches) entry.second.ref.release();
      on_gone.release();
      return;
    }
    py::gil_scoped_acquire gil;  // the last owner may be a thread without the GIL (autograd's)
    watches.clear();
    on_gone = py::object();
  }

  int category(const std::string& name) const {
    auto found = index.find(name);
    TORCH_CHECK(found != index.end(), "unknown memory category '", name, "'");
    return found->second;
  }

  // ---- the allocators' reports (any thread that carries this ledger) -----------------------

  void reportMemoryUsage(void* ptr, int64_t alloc_size, size_t, size_t, c10::Device device) override {
    if (device.type() != device_type) return;  // other devices' reports: host scalars of a GPU step
    std::lock_guard<std::mutex> held(mutex);
    if (!hearing) return;
    ++reports;
    auto address = reinterpret_cast<int64_t>(ptr);
    if (alloc_size < 0) {
      free(address);
      return;
    }
    int base = pending >= 0 ? pending : (scope >= 0 ? scope : temporaries);
    pending = -1;
    insert(address, alloc_size, base);
  }
  bool memoryProfilingEnabled() const override { return true; }
  profiler::ActiveProfilerType profilerType() override { return profiler::ActiveProfilerType::NONE; }

  // ---- StorageLedger's rules, by address (callers hold the lock) ---------------------------

  int category_of(const Record& r) const { return r.saved && becomes_activation[r.base] ? activations : r.base; }

  void copy_peak() {
    peak_totals = totals;
    peak_temps = temps;
    at_peak = false;
  }

  void add(int64_t address, const Record& r, int64_t nbytes) {
    int cat = category_of(r);
    totals[cat] += nbytes;
    if (totals[cat] > maxes[cat]) maxes[cat] = totals[cat];
    total += nbytes;
    if (cat == temporaries) temps.insert(address);
    if (total > peak_total) {  // the breakdown is copied only when the total leaves the peak
      peak_total = total;
      peak_label = label;
      at_peak = true;
    }
  }

  void free(int64_t address) {
    auto found = live.find(address);
    if (found == live.end()) return;
    if (at_peak) copy_peak();
    totals[category_of(found->second)] -= found->second.nbytes;
    total -= found->second.nbytes;
    temps.erase(address);
    peak_temps.erase(address);  // the address may be reused by a storage that becomes a grad
    live.erase(found);
  }

  Record& insert(int64_t address, int64_t nbytes, int base) {
    if (live.count(address)) free(address);  // freed where the ledger could not hear it; reused
    Record& r = live[address] = Record{nbytes, base, 0, ++last_id};
    add(address, r, nbytes);
    return r;
  }

  Record* find(int64_t address) {
    auto found = live.find(address);
    return found == live.end() ? nullptr : &found->second;
  }

  // a storage learnt of from Python: unknown so far (from before tracking, or allocated where the
  // ledger could not hear it) it is booked now and `inserted` says so; none without memory
  Record* find_or_insert(int64_t address, int64_t nbytes, int base, bool& inserted) {
    inserted = false;
    if (Record* r = find(address)) return r;
    if (!address || !nbytes) return nullptr;
    inserted = true;
    return &insert(address, nbytes, base);
  }

  void change(int64_t address, Record& r, int base, int saved_delta) {
    int old = category_of(r);
    if (base >= 0) r.base = base;
    r.saved += saved_delta;
    int now = category_of(r);
    if (now == old) return;
    if (at_peak && old != temporaries) copy_peak();  // (a temporary's new role counts at the peak anyway)
    totals[old] -= r.nbytes;
    totals[now] += r.nbytes;
    if (totals[now] > maxes[now]) maxes[now] = totals[now];
    if (old == temporaries) {
      temps.erase(address);
      if (peak_temps.erase(address)) {
        peak_totals[temporaries] -= r.nbytes;
        peak_totals[now] += r.nbytes;
      }
    } else if (now == temporaries) {
      temps.insert(address);
    }
  }

  // ---- events (each takes the lock; none is booked once the results are final) --------------

  // the storage at `address` plays `base` from now on; the id of a record booked new, else 0
  uint64_t role(int64_t address, int64_t nbytes, int base) {
    std::lock_guard<std::mutex> held(mutex);
    if (frozen) return 0;
    bool inserted;
    Record* r = find_or_insert(address, nbytes, base, inserted);
    if (r == nullptr || inserted) return r ? r->id : 0;
    if (r->base != base) change(address, *r, base, 0);
    return 0;
  }

  // autograd saved a tensor of this storage: while saved it counts as activations, if its role is
  // one that saving turns into activations. (id of the record counted as saved, to release, or 0;
  // id of a record booked new, or 0)
  std::pair<uint64_t, uint64_t> save(int64_t address, int64_t nbytes) {
    std::lock_guard<std::mutex> held(mutex);
    if (frozen) return {0, 0};
    bool inserted;
    Record* r = find_or_insert(address, nbytes, other, inserted);
    uint64_t new_id = inserted ? r->id : 0;
    if (r == nullptr || !becomes_activation[r->base]) return {0, new_id};
    change(address, *r, -1, 1);
    return {r->id, new_id};
  }

  void release(int64_t address, uint64_t id) {  // autograd let go of what save() counted
    std::lock_guard<std::mutex> held(mutex);
    Record* r = find(address);
    if (!frozen && r && r->id == id) change(address, *r, -1, -1);
  }

  // a model input: counts as `other` if nothing claimed it yet; its record's id
  uint64_t seen(int64_t address, int64_t nbytes) {
    std::lock_guard<std::mutex> held(mutex);
    if (frozen) return 0;
    bool inserted;
    Record* r = find_or_insert(address, nbytes, other, inserted);
    return r ? r->id : 0;
  }

  void gone(int64_t address, uint64_t id) {  // a watched storage died: its free, unheard otherwise
    std::lock_guard<std::mutex> held(mutex);
    Record* r = find(address);
    if (!frozen && r && r->id == id) free(address);
  }

  void mark(const std::string& name) {
    std::lock_guard<std::mutex> held(mutex);
    if (frozen) return;
    label = name;
    timeline.emplace_back(name, totals);
  }

  Results results() {
    std::lock_guard<std::mutex> held(mutex);
    if (at_peak) copy_peak();
    return Results{peak_totals, totals, maxes, std::max<int64_t>(peak_total, 0), peak_label, timeline};
  }

  c10::DeviceType device_type;
  std::vector<std::string> names;
  std::unordered_map<std::string, int> index;
  int temporaries, activations, other;
  std::vector<bool> becomes_activation;

  std::mutex mutex;      // guards what follows, up to the GIL's part
  bool hearing = false;  // between start() and stop(): reports are booked
  bool frozen = false;   // results are final: later events change nothing
  int64_t reports = 0;   // allocations and frees booked
  std::unordered_map<int64_t, Record> live;
  Totals totals, maxes, peak_totals;
  int64_t total = 0, peak_total = -1;
  bool at_peak = false;  // the running totals are the peak's and not copied yet
  std::unordered_set<int64_t> temps, peak_temps;
  std::string label = "start", peak_label = "start";
  std::vector<std::pair<std::string, Totals>> timeline;
  int scope = -1;    // the innermost tag_scope's category: the role of new allocations
  int pending = -1;  // the role of the next allocation (the one a resize makes)
  uint64_t last_id = 0;

  // touched only with the GIL held (from Python, or from a weak reference's callback)
  std::unordered_set<int64_t> never_saved;  // parameters and buffers: never activations
  struct Watch {
    py::object ref;  // the weak reference to the storage object
    int64_t address;
    uint64_t id;     // the record it frees when the storage dies
  };
  std::unordered_map<int64_t, Watch> watches;  // by the weak reference's address
  py::object on_gone;                          // their callback
};

using LedgerPtr = std::shared_ptr<Ledger>;
LedgerPtr listening;  // the ledger pushed on the tracking thread: one at a time in a process

// ---- what Python hands over (the GIL is held) -----------------------------------------------

// follow the storage object `storage` by weak reference: record `id` is freed when it dies.
// A watch is known by its weak reference's address; one callback serves all of a ledger's.
void watch(const LedgerPtr& ledger, py::handle storage, int64_t address, uint64_t id) {
  if (!id) return;
  if (!ledger->on_gone) {
    std::weak_ptr<Ledger> weak = ledger;  // the callback must not keep the ledger alive
    ledger->on_gone = py::cpp_function([weak](py::handle ref) {
      auto alive = weak.lock();
      if (!alive) return;
      auto found = alive->watches.find(reinterpret_cast<int64_t>(ref.ptr()));
      if (found == alive->watches.end()) return;
      Ledger::Watch watch = std::move(found->second);  // (the call holds the reference too)
      alive->watches.erase(found);
      alive->gone(watch.address, watch.id);
    });
  }
  PyObject* ref = PyWeakref_NewRef(storage.ptr(), ledger->on_gone.ptr());
  if (ref == nullptr) throw py::error_already_set();
  ledger->watches[reinterpret_cast<int64_t>(ref)] = {py::reinterpret_steal<py::object>(ref), address, id};
}

bool has_own_dispatch(PyObject* obj) {  // a tensor subclass with __torch_dispatch__ (a wrapper, say)
  return THPVariable_Check(obj) && THPVariable_Unpack(obj).unsafeGetTensorImpl()->is_python_dispatch();
}

// a tensor on the ledger's device, with memory: what the ledger books. A subclass with its own
// dispatch is not (its inner tensors hold the memory) unless `subclasses`
const at::Tensor* bookable(const Ledger& ledger, PyObject* obj, bool subclasses = false) {
  if (!THPVariable_Check(obj) || (!subclasses && has_own_dispatch(obj))) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || !t.has_storage() || t.device().type() != ledger.device_type) return nullptr;
  return &t;
}

int64_t address_of(const at::Tensor& t) { return reinterpret_cast<int64_t>(t.storage().data_ptr().get()); }

py::object storage_object(const at::Tensor& t) {
  return py::reinterpret_steal<py::object>(torch::createPyObject(t.storage()));
}

// the storages of `tensors` play `role` from now on (or the category `category_of(storage)`
// gives, when it gives one); returns the subclasses with their own dispatch it left for the caller
// to open (their inner tensors hold the memory), unless `subclasses`: then it books them too
py::list roles(const LedgerPtr& ledger, const py::iterable& tensors, const std::string& role,
               const py::object& category_of, bool subclasses) {
  int base = ledger->category(role);
  py::list unbooked;
  for (py::handle item : tensors) {
    const at::Tensor* t = bookable(*ledger, item.ptr(), subclasses);
    if (t == nullptr) {
      if (!subclasses && has_own_dispatch(item.ptr())) unbooked.append(item);
      continue;
    }
    py::object storage;
    int category = base;
    if (!category_of.is_none()) {
      storage = storage_object(*t);
      py::object tagged = category_of(storage);
      if (!tagged.is_none()) category = ledger->category(tagged.cast<std::string>());
    }
    int64_t address = address_of(*t);
    uint64_t id = ledger->role(address, static_cast<int64_t>(t->storage().nbytes()), category);
    if (id) watch(ledger, storage ? storage : storage_object(*t), address, id);
  }
  return unbooked;
}

// what pack() returns for a tensor whose storage counts as saved: its end is the release
struct SavedForBackward {
  SavedForBackward(py::object tensor, LedgerPtr ledger, int64_t address, uint64_t id)
      : tensor(std::move(tensor)), ledger(std::move(ledger)), address(address), id(id) {}
  SavedForBackward(const SavedForBackward&) = delete;
  SavedForBackward& operator=(const SavedForBackward&) = delete;
  ~SavedForBackward() { ledger->release(address, id); }
  py::object tensor;
  LedgerPtr ledger;
  int64_t address;
  uint64_t id;  // the record counted as saved
};

// autograd's pack hook: a tensor saved for backward
py::object pack(const LedgerPtr& ledger, const py::object& obj) {
  const at::Tensor* t = bookable(*ledger, obj.ptr());
  if (t == nullptr) return obj;
  int64_t address = address_of(*t);
  if (ledger->never_saved.count(address)) return obj;
  auto [saved, id] = ledger->save(address, static_cast<int64_t>(t->storage().nbytes()));
  if (id) watch(ledger, storage_object(*t), address, id);
  // a tensor without grad_fn is kept as it is (no cycle through autograd's graph): no detach
  py::object kept = t->grad_fn() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(t->detach())) : obj;
  if (!saved) return kept;
  return py::cast(new SavedForBackward(std::move(kept), ledger, address, saved),
                  py::return_value_policy::take_ownership);
}

py::object unpack(const py::object& packed) {
  if (py::isinstance<SavedForBackward>(packed)) return packed.cast<SavedForBackward&>().tensor;
  return packed;
}

py::dict by_name(const Ledger& ledger, const Totals& totals) {
  py::dict out;
  for (size_t i = 0; i < ledger.names.size(); ++i) out[py::str(ledger.names[i])] = totals[i];
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<SavedForBackward>(m, "SavedForBackward");
  py::class_<Ledger, LedgerPtr>(m, "Ledger")
      .def(py::init<const std::string&, std::vector<std::string>, const std::vector<std::string>&>(),
           py::arg("device"), py::arg("categories"), py::arg("saved_become"))
      .def("start", [](const LedgerPtr& self) {
        TORCH_CHECK(!listening, "an allocation log is already running in this process (one MemoryTracker with "
                    "source='allocator' at a time)");
        // the hook holds one listener a thread: under a running profiler this one would take its reports
        TORCH_CHECK(c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE) == nullptr,
                    "PyTorch's profiler is running on this thread, and it listens on the hook the allocation "
                    "log needs; stop the profiler first");
        listening = self;
        {
          std::lock_guard<std::mutex> held(self->mutex);
          self->hearing = true;
        }
        c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, self);
      })
      .def("stop", [](const LedgerPtr& self) {
        TORCH_CHECK(listening == self, "this allocation log is not running");
        c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
        listening.reset();
        std::lock_guard<std::mutex> held(self->mutex);
        self->hearing = false;  // a thread that kept the debug info is not heard after this
      })
      .def("freeze", [](const LedgerPtr& self) {  // results are final; the watches are dropped
        {
          std::lock_guard<std::mutex> held(self->mutex);
          self->frozen = true;
        }
        self->watches.clear();
        self->on_gone = py::object();
      })
      .def("never_save", [](const LedgerPtr& self, const std::vector<int64_t>& addresses) {
        self->never_saved.insert(addresses.begin(), addresses.end());
      })
      .def("roles", &roles, py::arg("tensors"), py::arg("role"), py::arg("category_of") = py::none(),
           py::arg("subclasses") = false)
      .def("pack", &pack)
      .def_static("unpack", &unpack)
      .def("seen", [](const LedgerPtr& self, const py::object& storage, int64_t address, int64_t nbytes) {
        watch(self, storage, address, self->seen(address, nbytes));
      })
      .def("role", [](const LedgerPtr& self, const py::object& storage, int64_t address, int64_t nbytes,
                      const std::string& role) {
        watch(self, storage, address, self->role(address, nbytes, self->category(role)));
      })
      .def("mark", [](const LedgerPtr& self, const std::string& label) { self->mark(label); })
      .def("scope", [](const LedgerPtr& self, std::optional<std::string> role) {
        int category = role ? self->category(*role) : -1;
        std::lock_guard<std::mutex> held(self->mutex);
        if (!self->frozen) self->scope = category;
      })
      // the allocation a resize makes keeps the storage's role (or takes its tag)
      .def("resize_from", [](const LedgerPtr& self, int64_t address, int64_t size, std::optional<std::string> tag) {
        int tagged = tag ? self->category(*tag) : -1;
        std::lock_guard<std::mutex> held(self->mutex);
        if (self->frozen) return;
        Record* r = self->find(address);
        self->pending = !size ? -1 : tagged >= 0 ? tagged : r ? r->base : -1;
      })
      .def("resize_to", [](const LedgerPtr& self) {
        std::lock_guard<std::mutex> held(self->mutex);
        if (!self->frozen) self->pending = -1;
      })
      // results (bytes): {"peak", "current", "max_by_category": {category: bytes}, "peak_total",
      // "peak_label", "timeline": [(label, {category: bytes})]}; peak_total() alone is cheaper
      .def("results", [](const LedgerPtr& self) {
        Results r = self->results();
        py::list timeline;
        for (const auto& [label, totals] : r.timeline) timeline.append(py::make_tuple(label, by_name(*self, totals)));
        py::dict out;
        out["peak"] = by_name(*self, r.peak);
        out["current"] = by_name(*self, r.current);
        out["max_by_category"] = by_name(*self, r.maxes);
        out["peak_total"] = r.peak_total;
        out["peak_label"] = r.peak_label;
        out["timeline"] = timeline;
        return out;
      })
      .def("peak_total", [](const LedgerPtr& self) {
        std::lock_guard<std::mutex> held(self->mutex);
        return std::max<int64_t>(self->peak_total, 0);
      })
      .def("live_bytes", [](const LedgerPtr& self) {
        std::lock_guard<std::mutex> held(self->mutex);
        int64_t sum = 0;
        for (const auto& entry : self->live) sum += entry.second.nbytes;
        return sum;
      })
      .def("category_at", [](const LedgerPtr& self, int64_t address) -> std::optional<std::string> {
        std::lock_guard<std::mutex> held(self->mutex);
        Record* r = self->find(address);
        if (!r) return std::nullopt;
        return self->names[self->category_of(*r)];
      })
      .def("reports", [](const LedgerPtr& self) {
        std::lock_guard<std::mutex> held(self->mutex);
        return self->reports;
      });
}

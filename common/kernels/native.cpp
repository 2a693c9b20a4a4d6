// The sender's per-bucket checks and the CPU byte copies of `common.native`, built by torch's
// JIT loader (`load_inline`: one build per ninja, Python and torch; rebuilt when this changes).
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>

namespace py = pybind11;

int64_t scalar_type(const at::Tensor& t) { return static_cast<int64_t>(t.scalar_type()); }

// Item i's tensor object when it is a (name, plain tensor or Parameter) pair, else nullptr.
static PyObject* item_tensor(PyObject* items, Py_ssize_t i) {
  PyObject* item = PyList_GET_ITEM(items, i);
  return PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2 ? PyTuple_GET_ITEM(item, 1) : nullptr;
}

// Entry i of a list of tensor objects (`take_mapping`'s own list).
static PyObject* list_tensor(PyObject* tensors, Py_ssize_t i) {
  return PyList_GET_ITEM(tensors, i);
}

static const at::Tensor* plain_tensor(PyObject* obj) {
  return obj && THPVariable_CheckExact(obj) ? &THPVariable_Unpack(obj) : nullptr;
}

// The scan runs right after a training step has evicted these objects from the host caches:
// fetch entry i + 12 (an item or a tensor object), i + 8's tensor object, i + Impl's
// TensorImpl and i + Storage's StorageImpl ahead (20,000 cold items on an H200 host: 4.0 ->
// 3.0 ms). Where an earlier pass has touched the tensor objects, further ahead.
template <PyObject* (*At)(PyObject*, Py_ssize_t), int Impl = 4, int Storage = 2>
static void prefetch_ahead(PyObject* seq, Py_ssize_t i, Py_ssize_t n) {
  if (i + 12 < n) __builtin_prefetch(PyList_GET_ITEM(seq, i + 12));
  if (i + 8 < n)
    if (PyObject* obj = At(seq, i + 8)) __builtin_prefetch(obj);
  if (i + Impl < n)
    if (const at::Tensor* t = plain_tensor(At(seq, i + Impl))) {
      const char* impl = reinterpret_cast<const char*>(t->unsafeGetTensorImpl());
      for (int line = 0; line < 4; ++line) __builtin_prefetch(impl + 64 * line);
    }
  if (i + Storage < n)
    if (const at::Tensor* t = plain_tensor(At(seq, i + Storage)); t && t->has_storage())
      __builtin_prefetch(t->unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
}

// A bucket's planned dtypes and shapes, the device the pointer kernel reads from, and where
// the addresses go.
struct Planned {
  const int8_t* dtypes;
  const int64_t* shapes;
  const int64_t* offsets;
  int64_t device_type, device_index;
  int64_t* ptrs;
};

// Whether tensor object `obj` is entry i as planned (dtype, shape); `direct` turns false when
// it cannot go through the pointer kernel, else its address goes to ptrs[i].
static bool check_one(PyObject* obj, Py_ssize_t i, const Planned& p, bool& direct) {
  if (!THPVariable_Check(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || static_cast<int8_t>(t.scalar_type()) != p.dtypes[i]) return false;
  auto sizes = t.sizes();
  if (static_cast<int64_t>(sizes.size()) != p.offsets[i + 1] - p.offsets[i]) return false;
  for (size_t d = 0; d < sizes.size(); ++d)
    if (sizes[d] != p.shapes[p.offsets[i] + d]) return false;
  if (!direct) return true;
  auto dev = t.device();
  if (static_cast<int64_t>(dev.type()) != p.device_type || dev.index() != p.device_index ||
      !t.is_contiguous() || t.is_neg() || t.is_conj()) {  // lazy sign/conj: not raw bytes
    direct = false;
    return true;
  }
  p.ptrs[i] = reinterpret_cast<int64_t>(t.data_ptr());
  return true;
}

static Planned planned(const at::Tensor& dtypes, const at::Tensor& shapes,
                       const at::Tensor& offsets, int64_t device_type, int64_t device_index,
                       at::Tensor& ptrs) {
  return {dtypes.data_ptr<int8_t>(), shapes.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
          device_type, device_index, ptrs.data_ptr<int64_t>()};
}

// One pass over a bucket's (name, tensor) items, borrowing every reference (no tensor copies,
// no refcount traffic). Returns (code, tensors): code -1 when every name, dtype and shape is as
// planned and every tensor is contiguous on the device (addresses in `ptrs`); -2 when all match
// but some cannot go through the pointer kernel; i >= 0 when item i does not match (tensors is
// None; the caller's Python path names the problem).
py::tuple take(const py::list& items, const py::list& names, const at::Tensor& dtypes,
               const at::Tensor& shapes, const at::Tensor& offsets, int64_t device_type,
               int64_t device_index, at::Tensor ptrs) {
  const Planned p = planned(dtypes, shapes, offsets, device_type, device_index, ptrs);
  const Py_ssize_t n = PyList_GET_SIZE(items.ptr());
  if (n != PyList_GET_SIZE(names.ptr()) || n != dtypes.numel())
    return py::make_tuple(0, py::none());
  py::list tensors(n);
  bool direct = true;
  for (Py_ssize_t i = 0; i < n; ++i) {
    prefetch_ahead<item_tensor>(items.ptr(), i, n);
    PyObject* item = PyList_GET_ITEM(items.ptr(), i);
    PyObject* obj = item_tensor(items.ptr(), i);
    PyObject* name = obj ? PyTuple_GET_ITEM(item, 0) : nullptr;
    PyObject* want = PyList_GET_ITEM(names.ptr(), i);
    if (!obj || (name != want && (!PyUnicode_Check(name) || PyUnicode_Compare(name, want) != 0))) {
      PyErr_Clear();
      return py::make_tuple(i, py::none());
    }
    if (!check_one(obj, i, p, direct)) return py::make_tuple(i, py::none());
    Py_INCREF(obj);
    PyList_SET_ITEM(tensors.ptr(), i, obj);
  }
  return py::make_tuple(direct ? -1 : -2, tensors);
}

// `take` for a bucket whose tensors a dict holds under the planned names: one lookup per name,
// no (name, tensor) item made. The same codes; a name the dict lacks is a mismatch (the
// caller's Python path names it).
py::tuple take_mapping(const py::dict& mapping, const py::list& names, const at::Tensor& dtypes,
                       const at::Tensor& shapes, const at::Tensor& offsets,
                       int64_t device_type, int64_t device_index, at::Tensor ptrs) {
  const Planned p = planned(dtypes, shapes, offsets, device_type, device_index, ptrs);
  const Py_ssize_t n = PyList_GET_SIZE(names.ptr());
  if (n != dtypes.numel()) return py::make_tuple(0, py::none());
  py::list tensors(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + 8 < n) __builtin_prefetch(PyList_GET_ITEM(names.ptr(), i + 8));  // its cached hash
    PyObject* obj = PyDict_GetItemWithError(mapping.ptr(), PyList_GET_ITEM(names.ptr(), i));
    if (!obj) {
      PyErr_Clear();
      return py::make_tuple(i, py::none());
    }
    Py_INCREF(obj);
    PyList_SET_ITEM(tensors.ptr(), i, obj);
  }
  bool direct = true;
  for (Py_ssize_t i = 0; i < n; ++i) {
    prefetch_ahead<list_tensor, 10, 5>(tensors.ptr(), i, n);
    if (!check_one(PyList_GET_ITEM(tensors.ptr(), i), i, p, direct))
      return py::make_tuple(i, py::none());
  }
  return py::make_tuple(direct ? -1 : -2, tensors);
}

// The CPU pack of a bucket whose sources `take` found contiguous on the CPU: one memcpy per
// slot, no per-tensor dispatch (a `torch.cat` needs a flattened view of every 2-D source).
void copy_bytes(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& nbytes) {
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* d = dst.data_ptr<int64_t>();
  const int64_t* n = nbytes.data_ptr<int64_t>();
  const int64_t count = nbytes.numel();
  TORCH_CHECK(src.numel() == count && dst.numel() == count, "copy_bytes: table sizes differ");
  py::gil_scoped_release no_gil;
  for (int64_t i = 0; i < count; ++i)
    if (n[i] > 0)
      std::memcpy(reinterpret_cast<void*>(d[i]), reinterpret_cast<const void*>(s[i]), n[i]);
}

// The delta codec on the CPU (common/delta/codec.py): 2-byte words of the new payload against its
// base. `delta_mask` writes the bitmask of the words that differ (bit j of byte k: word
// 8k + j) and returns their count; `delta_gather` stores those words in order; `delta_count`
// counts a bitmask's marks; `delta_scatter` writes the values back at the marked words.
int64_t delta_mask(const at::Tensor& now, const at::Tensor& base, const at::Tensor& mask) {
  const int16_t* a = now.data_ptr<int16_t>();
  const int16_t* b = base.data_ptr<int16_t>();
  uint8_t* m = mask.data_ptr<uint8_t>();
  const int64_t n = now.numel();
  TORCH_CHECK(base.numel() == n && mask.numel() == (n + 7) / 8, "delta_mask: sizes differ");
  py::gil_scoped_release no_gil;
  int64_t changed = 0;
  for (int64_t i = 0; i < n; i += 8) {
    uint8_t byte = 0;
    if (i + 8 <= n && std::memcmp(a + i, b + i, 16) == 0) {
      m[i / 8] = 0;
      continue;
    }
    const int64_t end = std::min<int64_t>(i + 8, n);
    for (int64_t j = i; j < end; ++j)
      byte |= static_cast<uint8_t>(a[j] != b[j]) << (j - i);
    m[i / 8] = byte;
    changed += __builtin_popcount(byte);
  }
  return changed;
}

void delta_gather(const at::Tensor& now, const at::Tensor& mask, const at::Tensor& values) {
  const int16_t* a = now.data_ptr<int16_t>();
  const uint8_t* m = mask.data_ptr<uint8_t>();
  int16_t* v = values.data_ptr<int16_t>();
  const int64_t bytes = mask.numel(), count = values.numel();
  py::gil_scoped_release no_gil;
  int64_t k = 0;
  for (int64_t i = 0; i < bytes && k < count; ++i)
    for (unsigned byte = m[i]; byte && k < count; byte &= byte - 1)
      v[k++] = a[i * 8 + __builtin_ctz(byte)];
}

int64_t delta_count(const at::Tensor& mask) {
  const uint8_t* m = mask.data_ptr<uint8_t>();
  const int64_t bytes = mask.numel();
  py::gil_scoped_release no_gil;
  int64_t marked = 0;
  for (int64_t i = 0; i < bytes; ++i) marked += __builtin_popcount(m[i]);
  return marked;
}

void delta_scatter(const at::Tensor& target, const at::Tensor& mask, const at::Tensor& values) {
  int16_t* t = target.data_ptr<int16_t>();
  const uint8_t* m = mask.data_ptr<uint8_t>();
  const int16_t* v = values.data_ptr<int16_t>();
  const int64_t bytes = mask.numel(), count = values.numel(), n = target.numel();
  TORCH_CHECK(bytes == (n + 7) / 8, "delta_scatter: the bitmask does not fit the target");
  py::gil_scoped_release no_gil;
  int64_t k = 0;
  for (int64_t i = 0; i < bytes && k < count; ++i)
    for (unsigned byte = m[i]; byte && k < count; byte &= byte - 1) {
      const int64_t w = i * 8 + __builtin_ctz(byte);
      if (w < n) t[w] = v[k++];
    }
}
